"""Feature capture: the residual stream after decoder layer k, i.e. HF hidden_states[k + 1]."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.models import TargetModel
from tests.targets import FAMILIES, tiny_target


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_features_are_hf_hidden_states_k_plus_1(family):
    layers = 6
    model = tiny_target(family, layers=layers)
    layer_ids = [4, 0, 2, 3, 1, 5]  # listed order, not sorted, decides the concatenation order
    target = TargetModel(model, layer_ids)
    ids = torch.randint(0, 90, (2, 11))
    with torch.no_grad():
        logits, features = target.forward_with_features(ids)
        reference = model(ids, output_hidden_states=True)
    assert torch.equal(logits, reference.logits)
    hidden = target.hidden_size
    assert features.shape == (2, 11, len(layer_ids) * hidden)
    for slot, k in enumerate(layer_ids):
        captured = features[..., slot * hidden : (slot + 1) * hidden]
        if k < layers - 1:
            assert torch.equal(captured, reference.hidden_states[k + 1]), (family, k)
        else:
            # HF's last entry is taken after the final norm; ours is the raw residual stream.
            assert torch.allclose(model.model.norm(captured), reference.hidden_states[k + 1]), family


def test_hooks_sit_on_the_selected_layers_only_and_keep_nothing_alive():
    model = tiny_target("llama", layers=6)
    target = TargetModel(model, [1, 4])
    hooked = [i for i, layer in enumerate(target.layers) if layer._forward_hooks]
    assert hooked == [1, 4]
    target.forward_with_features(torch.randint(0, 90, (1, 5)))
    assert target._captured == {}
    target.close()
    assert not any(layer._forward_hooks for layer in target.layers)


def test_no_layer_ids_means_no_features():
    target = TargetModel(tiny_target("qwen2", layers=4))
    logits, features = target.forward_with_features(torch.randint(0, 90, (1, 5)))
    assert features is None and logits.shape == (1, 5, 96)


def test_out_of_range_layer_id_is_refused():
    with pytest.raises(ValueError, match="target has 4 decoder layers"):
        TargetModel(tiny_target("llama", layers=4), [1, 4])


def test_gemma_embedding_scale_and_softcap_are_the_targets():
    model = tiny_target("gemma3", softcap=30.0)
    target = TargetModel(model, [1])
    ids = torch.tensor([[3, 4]])
    raw = model.model.embed_tokens.weight[ids]
    assert torch.allclose(target.embed(ids), raw * 32**0.5)
    assert target.final_logit_softcapping == 30.0
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        assert torch.allclose(target.logits(hidden), model(ids).logits)


def test_a_gemma4_multimodal_checkpoint_loads_its_text_model_alone(tmp_path, caplog):
    """google/gemma-4-31B-it is a Gemma4ForConditionalGeneration checkpoint: the target is its
    text model (Gemma4ForCausalLM, the checkpoint's text weights), the vision tower stays on disk."""
    import logging

    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.targets import gemma4_31b_twin

    text = gemma4_31b_twin(seed=1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    full = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.config.to_dict(), vision_config=vision))
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="dflash_serve.services.models.target"):
        target = TargetModel.from_pretrained(str(tmp_path), (1, 4), dtype=torch.float32)
    assert type(target.model).__name__ == "Gemma4ForCausalLM"
    assert not any("vision" in name for name, _ in target.model.named_parameters())
    assert "text model (Gemma4ForCausalLM) of a gemma4 checkpoint" in caplog.text
    ids = torch.tensor([[5, 9, 14, 3, 77, 8, 21]])
    with torch.no_grad():
        logits, features = target.forward_with_features(ids)
        reference = full.float().eval()(input_ids=ids, output_hidden_states=True)
    assert torch.equal(logits, reference.logits)
    hidden = target.hidden_size
    assert torch.equal(features[..., :hidden], reference.hidden_states[2])
