"""The target model: any Hugging Face causal LM, with the drafter's feature capture.

Feature k is the residual stream right after decoder layer k (after its MLP residual add,
before the final norm) — HF's `hidden_states[k + 1]`. We take it with forward hooks on the
selected layers only: `output_hidden_states=True` would keep every layer's states alive
(18.5 GB at 64 K tokens on Qwen3-8B) for the same bits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_serve.kernels import SkinnyLinear
from dflash_serve.services.models.revision import folder_revision_error

if TYPE_CHECKING:  # transformers' model code is imported where a target is loaded, not with this module,
    # which the drafter's process imports too (seconds of its start: BENCHMARKS, Restarts)
    from transformers import PreTrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)


class TargetLoadError(RuntimeError):
    """The target model could not be loaded; the message says where it was looked for."""


def _cannot_load(name_or_path: str, err: OSError) -> TargetLoadError:
    return TargetLoadError(
        f"cannot load target '{name_or_path}': {err}. Pass a local folder holding config.json and "
        "*.safetensors, or a hub repo id on a machine that reaches the hub (or has it in the HF cache)."
    )


def load_target_config(name_or_path: str, revision: str | None = None) -> PreTrainedConfig:
    """The target's text config alone (no weights), with the same error as loading the model."""
    from transformers import AutoConfig

    _check_revision(name_or_path, revision)
    try:
        return AutoConfig.from_pretrained(name_or_path, revision=revision).get_text_config()
    except OSError as err:
        raise _cannot_load(name_or_path, err) from err


def _check_revision(name_or_path: str, revision: str | None) -> None:
    error = folder_revision_error("target", name_or_path, revision)
    if error:
        raise TargetLoadError(error)


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder-layer list of a causal LM, also when the text model sits inside a multimodal
    wrapper (Gemma-3/4 conditional-generation checkpoints)."""
    for base in (model.get_decoder(), getattr(model, "model", None), getattr(model, "language_model", None)):
        for candidate in (base, getattr(base, "language_model", None)):
            layers = getattr(candidate, "layers", None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    raise TargetLoadError(f"{type(model).__name__}: cannot find its decoder layers (looked for .model.layers)")


# Multimodal checkpoints (model_type -> where their text model's weights are) whose text model is
# served alone: vision and audio towers are never read into (GPU) memory. (Gemma-3's published
# checkpoints keep an older layout that transformers converts on load: they load whole, as before.)
TEXT_MODEL_PREFIX = {"gemma4": "model.language_model."}


def _load_text_model(name_or_path: str, config: PreTrainedConfig, *, dtype, revision: str | None,
                     device: str | torch.device) -> PreTrainedModel:
    """The causal LM of a multimodal checkpoint's text config (Gemma-4's `…ForCausalLM`), with
    the checkpoint's text weights; every text weight must be there, and only other modalities'
    are left unread."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text_config = config.get_text_config()
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    prefix = TEXT_MODEL_PREFIX[config.model_type]
    # transformers logs every unread tensor as a load-report warning; what is left is checked here.
    report_logger = logging.getLogger("transformers.modeling_utils")
    level = report_logger.level
    report_logger.setLevel(logging.ERROR)
    try:
        model, info = model_class.from_pretrained(
            name_or_path, config=text_config, dtype=dtype, revision=revision, output_loading_info=True,
            key_mapping={"^" + re.escape(prefix): "model."}, device_map=str(torch.device(device)))
    finally:
        report_logger.setLevel(level)
    text_keys = [k for k in info["unexpected_keys"] if k.startswith("model.") and not _other_modality(k)]
    if info["missing_keys"] or text_keys or info["mismatched_keys"]:
        raise TargetLoadError(
            f"cannot load the text model of '{name_or_path}' ({config.model_type}) as {model_class.__name__}: "
            f"missing {sorted(info['missing_keys'])[:5]}, unread text weights {sorted(text_keys)[:5]}, "
            f"mismatched {sorted(info['mismatched_keys'])[:5]}")
    log.info("target %s: the text model (%s) of a %s checkpoint; %d tensors of other modalities left unread",
             name_or_path, model_class.__name__, config.model_type, len(info["unexpected_keys"]))
    return model


def _other_modality(key: str) -> bool:
    return any(part in key for part in ("vision", "audio"))


class TargetModel:
    """Wraps an HF causal LM: forward with feature capture, input embedding, LM head."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int] = ()):
        self.model = model
        self.config = model.config.get_text_config()
        self.layers = decoder_layers(model)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        for k in self.layer_ids:
            if not 0 <= k < len(self.layers):
                raise ValueError(f"target_layer_ids contains {k}, but the target has {len(self.layers)} decoder layers")
        self.input_embeddings: nn.Embedding = model.get_input_embeddings()
        output_embeddings = model.get_output_embeddings()
        if output_embeddings is None:
            raise TargetLoadError(f"{type(model).__name__} has no output embeddings (LM head)")
        # The LM head of the engine's logits (the verify's few rows and the drafter's take the
        # one-launch kernel on a GPU), over the module's own parameters.
        self.lm_head = SkinnyLinear(output_embeddings.weight, output_embeddings.bias)
        self.final_logit_softcapping: float | None = getattr(self.config, "final_logit_softcapping", None) or None
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self.layers[k].register_forward_hook(self._capture_hook(k)) for k in sorted(set(self.layer_ids))]

    def _capture_hook(self, k: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        layer_ids: Sequence[int] = (),
        *,
        dtype: torch.dtype | str = "auto",
        device: str | torch.device = "cpu",
        revision: str | None = None,
    ) -> TargetModel:
        """revision: the hub commit or tag of a repo id (None: its default branch)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        _check_revision(name_or_path, revision)
        try:
            config = AutoConfig.from_pretrained(name_or_path, revision=revision)
            # Straight to the device: not a copy of every weight in host memory first (16 GB for an 8B target).
            if config.model_type in TEXT_MODEL_PREFIX:
                model = _load_text_model(name_or_path, config, dtype=dtype, revision=revision, device=device)
            else:
                model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=dtype,
                                                             revision=revision, device_map=str(torch.device(device)))
        except OSError as err:
            raise _cannot_load(name_or_path, err) from err
        return cls(model.eval(), layer_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def embedding_rows(self) -> int:
        return int(self.input_embeddings.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_embeddings.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's own input embedding, with whatever scaling it applies (Gemma: × sqrt(H))."""
        return self.input_embeddings(ids)

    def logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
        """LM head (`lm_head` over the same weight, or the target's own) on final-normed hidden
        states, with the target's softcap (Gemma) applied."""
        logits = (self.lm_head if lm_head is None else lm_head)(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward_with_features(self, input_ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target; -> (logits, features [.., T, F*H] in `layer_ids` order, or None without ids)."""
        self._captured.clear()
        try:
            logits = self.model(input_ids=input_ids, **kwargs).logits
            if not self.layer_ids:
                return logits, None
            features = torch.cat([self._captured[k] for k in self.layer_ids], dim=-1)
        finally:
            self._captured.clear()  # never keep activations alive between calls
        return logits, features

    def close(self) -> None:
        """Remove the capture hooks (the wrapped HF model is left as it was)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
