"""Shared builders for tests: tiny random targets and drafters, written in the z-lab format."""

from __future__ import annotations

import copy
import gc
import math
import os
import tempfile
from pathlib import Path

# One thread per test process (and for the processes tests start: CLI runs, Ray's workers, the
# interpreted-kernels child): the models here are tiny, so intra-op threads only add
# synchronisation, and on CI's 2 cores two threads per process oversubscribe the machine as soon
# as a second process (a Ray actor, a parallel test worker) runs, which slows torch down ~10x.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from dflash_serve.services.models import DFlashDraftConfig, DFlashDraftModel
from dflash_serve.services.models.default_pair import TARGET_NAME, cache_dir


def _this_runs_model_cache() -> None:
    """This run's model cache ($DFLASH_CACHE, which Ray's workers and the CLI inherit): a link to
    the converted default target in the user's, and room for what engines and routers write there
    (round costs, tokenizer classes), which no other run may read and the user's must not collect."""
    users, run = cache_dir(), Path(tempfile.mkdtemp(prefix="dflash-test-cache-"))
    if (users / TARGET_NAME).is_dir():
        (run / TARGET_NAME).symlink_to((users / TARGET_NAME).resolve())
    os.environ["DFLASH_CACHE"] = str(run)


_this_runs_model_cache()


def drafter_config(**overrides) -> dict:
    """A tiny z-lab-style config.json dict (Qwen3-8B-DFlash-b16 layout at toy size)."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # nh*hd = 64 != H: must be read from config, not derived
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "vocab_size": 96,
        "block_size": 16,
        "num_target_layers": 8,
        "layer_types": ["full_attention"] * 5,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 2, 4, 5, 6]},
    }
    for key, value in overrides.items():
        if key == "dflash_config":
            cfg["dflash_config"] = {**cfg["dflash_config"], **value}
        else:
            cfg[key] = value
    return copy.deepcopy(cfg)


def random_drafter(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float64) -> DFlashDraftModel:
    """Weights large enough that attention is far from uniform and norms are not all ones."""
    model = DFlashDraftModel(DFlashDraftConfig.from_dict(cfg)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
    return model.eval()


def gemma4_drafter(*, block_size: int, seed: int, vocab_size: int = 96) -> DFlashDraftModel:
    """The z-lab Gemma-4 drafter layout at toy size, for the 6-layer twins of tests/targets.py: a
    sliding-window layer (causal) then a full one, 3 target features for 2 layers, Gemma-4's
    <mask> (4) as the mask token; float32."""
    cfg = drafter_config(block_size=block_size, vocab_size=vocab_size, num_target_layers=6, num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                         dflash_config={"mask_token_id": 4, "target_layer_ids": [1, 2, 4]})
    return random_drafter(cfg, seed=seed, dtype=torch.float32)


# Test files whose tests share a server that a session fixture starts (tests/integration's
# ray_serve: a Ray cluster with Serve): under pytest-xdist they run in one worker, one after the other.
SHARED_SERVER_FILES = ("tests/integration/test_openai.py", "tests/integration/test_serve.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README's `pytest -n 2 --dist loadfile`: each file is one unit of work, so its module
    fixtures are built once, and the SHARED_SERVER_FILES are one unit together, so their server
    starts once (not once per worker, side by side)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return " + ".join(SHARED_SERVER_FILES) if scope in SHARED_SERVER_FILES else scope

    return SharedServerFiles(config, log)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """A test that builds a serving process's object (`freeze_startup_objects`) leaves the test
    process's collector as it found it: frozen objects are never collected."""
    yield
    gc.unfreeze()
