"""DFlash draft model, target adapter (feature capture) and checkpoint I/O.

Each name is imported on first use (PEP 562): the package's light modules (`default_pair`,
`draft_config`) then load without torch and transformers, which `dflash serve`'s own process, whose
engine runs in others, would otherwise import for 3-4 s before it starts Ray."""

from dflash_serve.services.lazy_names import names_on_first_use

_MODULE_OF = {
    "CheckpointError": "checkpoint", "load_drafter": "checkpoint", "save_drafter": "checkpoint",
    "DFlashDraftModel": "draft", "DraftAttentionContext": "draft", "DraftContext": "draft",
    "DFlashDraftConfig": "draft_config", "DraftConfigError": "draft_config", "default_target_layer_ids": "draft_config",
    "TargetLoadError": "target", "TargetModel": "target", "load_target_config": "target",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = names_on_first_use(__name__, _MODULE_OF)
