"""Read and write drafter checkpoints in the z-lab format (dflash-spec §2).

A checkpoint is a folder with config.json and safetensors weights (one file or an index of
shards) named as in spec §1.1 — no `model.` prefix, no embedding, no LM head. Loading is strict:
a missing, unexpected or mis-shaped tensor is an error that names it, because a drafter that
loads "mostly" runs but accepts nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_serve.services.models.draft import DFlashDraftModel
from dflash_serve.services.models.draft_config import DFlashDraftConfig, DraftConfigError
from dflash_serve.services.models.revision import folder_revision_error

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A drafter checkpoint cannot be used; the message names the file or tensor and what to fix."""


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None) -> Path:
    """A local folder, or a hub repo id fetched (or found in the HF cache) with huggingface_hub
    at `revision` (a commit or tag; None: the repo's default branch)."""
    path = Path(name_or_path).expanduser()
    error = folder_revision_error("drafter", name_or_path, revision)
    if error:
        raise CheckpointError(error)
    if path.exists():
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(f"{path} has no {CONFIG_NAME}: a DFlash drafter folder holds config.json and *.safetensors")
        return path
    name = str(name_or_path)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"drafter folder {name} does not exist (and it is not a hub repo id like 'z-lab/Qwen3-8B-DFlash-b16')")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            name, revision=revision, allow_patterns=[CONFIG_NAME, "*.safetensors", INDEX_NAME]
        )
    except Exception as err:  # offline, unknown repo, gated, …: all end the same way for the user
        raise CheckpointError(
            f"cannot fetch drafter '{name}' from the Hugging Face hub ({type(err).__name__}: {err}). "
            f"On a machine without hub access, copy {CONFIG_NAME} and the *.safetensors files of that repo "
            "into a folder and pass the folder's path instead of the repo id."
        ) from err
    return Path(folder)


def read_draft_config(folder: Path) -> DFlashDraftConfig:
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
        return DFlashDraftConfig.from_dict(raw)
    except (json.JSONDecodeError, DraftConfigError) as err:
        raise CheckpointError(f"{folder / CONFIG_NAME}: {err}") from err


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    elif (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"{folder}: no safetensors weights found" + (f" (missing {missing})" if missing else ""))
    return files


def read_state_dict(folder: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key in state:
                    raise CheckpointError(f"tensor '{key}' appears in more than one weight file ({file.name})")
                state[key] = f.get_tensor(key)
    return state


def count_weights(folder: Path) -> int:
    """How many numbers the checkpoint's weights hold, read from the safetensors headers alone."""
    count = 0
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                count += math.prod(f.get_slice(name).get_shape())
    return count


def check_state_dict(model: DFlashDraftModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict: every expected tensor present with its exact shape, nothing else."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = []
    for key in sorted(expected.keys() - state.keys()):
        problems.append(f"missing tensor '{key}' (expected shape {list(expected[key])})")
    for key in sorted(state.keys() - expected.keys()):
        problems.append(f"unexpected tensor '{key}' (shape {list(state[key].shape)})")
    for key in sorted(expected.keys() & state.keys()):
        if tuple(state[key].shape) != expected[key]:
            problems.append(f"tensor '{key}' has shape {list(state[key].shape)}, config.json implies {list(expected[key])}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; … {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{source} does not match its config.json: {shown}")


def load_drafter(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> DFlashDraftModel:
    """Load a z-lab-format drafter; dtype defaults to the checkpoint's own (`dtype` in config.json)."""
    folder = resolve_checkpoint(name_or_path, revision)
    config = read_draft_config(folder)
    dtype = dtype or getattr(torch, config.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{folder / CONFIG_NAME}: unknown dtype {config.dtype!r}")
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        model = DFlashDraftModel(config)
    state = read_state_dict(folder, device)
    check_state_dict(model, state, str(folder))
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def save_drafter(model: DFlashDraftModel, folder: str | Path) -> Path:
    """Write config.json + model.safetensors, exactly the tensors `load_drafter` expects."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder
