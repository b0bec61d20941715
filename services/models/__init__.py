"""DFlash draft model, target adapter (feature capture) and checkpoint I/O."""

from services.models.checkpoint import CheckpointError, load_drafter, save_drafter
from services.models.draft import DFlashDraftModel, DraftAttentionContext, DraftContext
from services.models.draft_config import DFlashDraftConfig, DraftConfigError, default_target_layer_ids
from services.models.target import TargetLoadError, TargetModel, load_target_config

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
