"""z-lab checkpoint I/O: bit-exact round trip, strict loading that names the key, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_serve.services.models import CheckpointError, DFlashDraftConfig, DraftConfigError, TargetModel, load_drafter, save_drafter
from dflash_serve.services.models.checkpoint import INDEX_NAME
from tests.conftest import drafter_config, random_drafter
from tests.targets import tiny_target


@pytest.fixture
def saved(tmp_path):
    model = random_drafter(drafter_config(), dtype=torch.bfloat16)
    return model, save_drafter(model, tmp_path / "drafter")


def test_round_trip_is_bit_exact(saved):
    model, folder = saved
    loaded = load_drafter(folder)
    assert loaded.dtype == torch.bfloat16
    assert loaded.config == model.config
    original, reloaded = model.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for key in original:
        assert torch.equal(original[key], reloaded[key]), key


def test_written_files_follow_the_z_lab_format(saved):
    model, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["dflash_config"]["mask_token_id"] == 95
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 4, 5, 6]
    names = set(load_file(folder / "model.safetensors"))
    assert len(names) == 5 * 11 + 3  # per layer 11 tensors, plus fc, hidden_norm, norm
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)
    # fc is sized from the number of features times H.
    assert load_file(folder / "model.safetensors")["fc.weight"].shape == (32, 5 * 32)


def _rewrite(folder, edit):
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_missing_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda s: s.pop("layers.3.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.3\.mlp\.up_proj\.weight'"):
        load_drafter(folder)


def test_unexpected_tensor_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda s: s.update({"embed_tokens.weight": torch.zeros(96, 32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'embed_tokens\.weight'"):
        load_drafter(folder)


def test_wrong_shape_is_named(saved):
    _, folder = saved
    _rewrite(folder, lambda s: s.update({"fc.weight": torch.zeros(32, 4 * 32)}))
    with pytest.raises(CheckpointError, match=r"tensor 'fc\.weight' has shape \[32, 128\], config\.json implies \[32, 160\]"):
        load_drafter(folder)


def test_sharded_checkpoint_loads(saved):
    model, folder = saved
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, folder / name)
    index = {"weight_map": {k: name for name, names in shards.items() for k in names}}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    loaded = load_drafter(folder)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_missing_folder_and_non_folder_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_drafter(tmp_path / "empty")


def test_hub_repo_offline_says_where_to_put_the_files(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="copy config.json and the \\*.safetensors files"):
        load_drafter("z-lab/Qwen3-8B-DFlash-b16")


def test_bad_config_names_the_field(saved):
    _, folder = saved
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no mask_token_id"):
        load_drafter(folder)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"layer_types": ["sliding_attention"] * 5, "sliding_window": None}, "sliding_window is not set"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types has 4 entries"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
        ({"block_size": 1}, "block_size=1"),
        ({"dflash_config": {"target_layer_ids": [1, 9]}}, "exceed num_target_layers=8"),
        ({"architectures": ["DFlash2DraftModel"]}, "expected \\['DFlashDraftModel'\\]"),
    ],
)
def test_invalid_configs_are_refused_with_the_reason(overrides, message):
    with pytest.raises(DraftConfigError, match=message):
        DFlashDraftConfig.from_dict(drafter_config(**overrides))


def test_block_size_and_mask_id_prefer_dflash_config():
    cfg = DFlashDraftConfig.from_dict(drafter_config(block_size=16, dflash_config={"block_size": 8, "mask_token_id": 90}))
    assert (cfg.block_size, cfg.mask_token_id) == (8, 90)
    top = drafter_config()
    top["mask_token_id"] = 94
    del top["dflash_config"]["mask_token_id"]
    assert DFlashDraftConfig.from_dict(top).mask_token_id == 94


def test_mask_id_must_exist_in_the_target_embedding():
    drafter = random_drafter(drafter_config(dflash_config={"mask_token_id": 151669}))
    target = TargetModel(tiny_target("qwen3"), drafter.config.target_layer_ids)
    with pytest.raises(ValueError, match="mask_token_id=151669 is not a row of the target embedding \\(96 rows\\)"):
        drafter.check_target(target)


def test_target_too_shallow_for_layer_ids_is_refused():
    drafter = random_drafter(drafter_config())
    target = TargetModel(tiny_target("qwen3", layers=4))
    with pytest.raises(ValueError, match="need a target with more than 6 layers; this one has 4"):
        drafter.check_target(target)
