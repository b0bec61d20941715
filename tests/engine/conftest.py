"""Every engine test runs over both target forwards (the fused layers and transformers' own
code) and both round loops (chained rounds, as on a GPU, and one host sync per round)."""

from __future__ import annotations

import pytest

from tests.engine import harness


@pytest.fixture(autouse=True, params=["fused", "transformers"])
def target_impl(request, monkeypatch):
    monkeypatch.setattr(harness, "TARGET_IMPL", request.param)
    return request.param


@pytest.fixture(autouse=True, params=[True, False], ids=["chained", "synced"])
def chain_rounds(request, monkeypatch):
    monkeypatch.setattr(harness, "CHAIN_ROUNDS", request.param)
    return request.param
