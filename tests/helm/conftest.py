from __future__ import annotations

import pytest

from tests.helm.chart import EXAMPLES, Rendered, render, scenario_values

SCENARIOS = ["default", *EXAMPLES]


@pytest.fixture(scope="session", params=SCENARIOS)
def scenario(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def values(scenario) -> dict:
    return scenario_values(scenario)


@pytest.fixture(scope="session")
def rendered(values) -> Rendered:
    return render(values)
