"""Round costs measured once and kept: a second start with the same models, settings and machine
loads them; anything they depend on changing, or an unreadable file, measures them again."""

from __future__ import annotations

import json
import logging

import pytest

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.round_cost_cache import RoundCostCache
from tests.served_pair import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def _engine(pair, costs_dir, **overrides):
    target, drafter = pair
    settings = {"max_num_seqs": 4, **overrides}
    return build_engine(EngineConfig(target=target, drafter=drafter, round_costs_dir=costs_dir, **settings))


def test_a_second_start_loads_the_costs_the_first_measured(pair, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_serve.services.engine")
    first = _engine(pair, str(tmp_path)).speculation.costs
    assert "round costs measured" in caplog.text
    (kept,) = tmp_path.glob("*.json")
    caplog.clear()
    second = _engine(pair, str(tmp_path)).speculation.costs
    assert "round costs measured" not in caplog.text and f"round costs from {kept}" in caplog.text
    assert second.batch_sizes == first.batch_sizes and second.ks == first.ks
    assert second.verify == first.verify and second.draft == first.draft
    assert second.verify_slope == first.verify_slope and second.context == first.context
    # Another setting the times depend on is another key: measured, and kept beside the first.
    caplog.clear()
    _engine(pair, str(tmp_path), max_num_seqs=2)
    assert "round costs measured" in caplog.text and len(list(tmp_path.glob("*.json"))) == 2


def test_empty_measures_at_every_start_and_keeps_nothing(pair, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="dflash_serve.services.engine")
    for _ in range(2):
        caplog.clear()
        assert _engine(pair, "").speculation.costs is not None
        assert "round costs measured" in caplog.text
    assert not list((tmp_path / "round-costs").rglob("*.json"))  # (the tokenizer class is kept: target_files)


def test_an_unreadable_file_is_measured_again_and_an_unwritable_folder_only_warned_about(tmp_path, caplog):
    cache = RoundCostCache(tmp_path, {"target": {"hidden_size": 8}})
    cache.path({"ks": [0, 1]}).write_text("{not json")
    assert cache.load({"ks": [0, 1]}) is None and "unreadable" in caplog.text
    cache.store({"ks": [0, 1]}, {"batch_sizes": [1], "verify": {0: [0.1]}})
    assert cache.load({"ks": [0, 1]}) == {"batch_sizes": [1], "verify": {"0": [0.1]}}
    assert cache.load({"ks": [0, 3]}) is None  # another key
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    RoundCostCache(blocked / "costs", {}).store({}, {"batch_sizes": [1]})  # its parent is a file: no folder there
    assert "not kept" in caplog.text
    assert json.loads(cache.path({"ks": [0, 1]}).read_text())["key"] == {"target": {"hidden_size": 8}, "ks": [0, 1]}
