"""DFlash draft model, target adapter (feature capture) and checkpoint I/O."""

from dflash_serve.services.models.checkpoint import CheckpointError, load_drafter, save_drafter
from dflash_serve.services.models.draft import DFlashDraftModel, DraftAttentionContext, DraftContext
from dflash_serve.services.models.draft_config import DFlashDraftConfig, DraftConfigError, default_target_layer_ids
from dflash_serve.services.models.target import TargetLoadError, TargetModel, load_target_config

__all__ = [
    "CheckpointError",
    "DFlashDraftConfig",
    "DFlashDraftModel",
    "DraftConfigError",
    "DraftAttentionContext",
    "DraftContext",
    "TargetLoadError",
    "TargetModel",
    "default_target_layer_ids",
    "load_drafter",
    "load_target_config",
    "save_drafter",
]
