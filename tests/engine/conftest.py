"""Every engine test runs over both target forwards: the fused layers and transformers' own code."""

from __future__ import annotations

import pytest

from tests.engine import harness


@pytest.fixture(autouse=True, params=["fused", "transformers"])
def target_impl(request, monkeypatch):
    monkeypatch.setattr(harness, "TARGET_IMPL", request.param)
    return request.param
