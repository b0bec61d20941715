"""The target's tokenizer (the engine's and the routers' one way to load it) and context length,
read without importing torch.

A router only tokenizes, but `AutoTokenizer` reads the model's config to choose the tokenizer's
class, and transformers' config module imports torch: on the H200 that and the config made a
router replica the last part of `dflash serve`'s start (BENCHMARKS, restarts). So the class
AutoTokenizer chose is kept in the model cache, by the tokenizer's and config's file contents and
the transformers version, and a later load imports that class alone — the same class, given the
same arguments. The context length is read from config.json (its text model's, in a multimodal
checkpoint's), where the engine's config object takes it from.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from pathlib import Path

from transformers.utils.hub import cached_file

from dflash_serve.services.models.default_pair import cache_dir
from dflash_serve.services.models.revision import folder_revision_error

log = logging.getLogger(__name__)
# What AutoTokenizer's choice depends on: the tokenizer's own config, the model's, and the tokenizer.
CHOICE_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")


def load_tokenizer(name: str, revision: str | None = None):
    """`AutoTokenizer.from_pretrained(name, revision=revision)`: through the class it chose at an
    earlier load where one is kept, else through AutoTokenizer (and its choice kept)."""
    record = _choice_record(name, revision)
    kept = _kept_class(record) if record is not None else None
    if kept is not None:
        return kept.from_pretrained(name, revision=revision)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    if record is not None:
        _keep_class(record, type(tokenizer))
    return tokenizer


def context_length(name: str, revision: str | None = None) -> int:
    """The target's context length as the engine takes it: `max_position_embeddings` of its
    (text) config, else 32768. From config.json where it says (the text model's in a multimodal
    checkpoint's); else from the config object, whose class may have a default (imports torch)."""
    error = folder_revision_error("target", name, revision)
    if error:
        raise ValueError(error)
    path = _file(name, "config.json", revision)
    if path is not None:
        config = json.loads(Path(path).read_text())
        value = (config.get("text_config") or config).get("max_position_embeddings")
        if value:
            return int(value)
    from dflash_serve.services.models.target import load_target_config

    return int(getattr(load_target_config(name, revision), "max_position_embeddings", 0) or 32768)


def _file(name: str, filename: str, revision: str | None) -> str | None:
    return cached_file(name, filename, revision=revision, _raise_exceptions_for_missing_entries=False)


def _choice_record(name: str, revision: str | None) -> Path | None:
    """Where AutoTokenizer's choice for these files is kept; None without a tokenizer config."""
    import transformers

    paths = [_file(name, filename, revision) for filename in CHOICE_FILES]
    if paths[0] is None:
        return None
    digest = hashlib.sha256(json.dumps([name, revision, transformers.__version__]).encode())
    for path in paths:
        digest.update(Path(path).read_bytes() if path is not None else b"\0")
    return cache_dir() / "tokenizer-classes" / f"{digest.hexdigest()[:24]}.json"


def _kept_class(record: Path) -> type | None:
    try:
        kept = json.loads(record.read_text())
        if not kept["module"].startswith("transformers."):  # a hub's own code: AutoTokenizer loads it
            return None
        return getattr(importlib.import_module(kept["module"]), kept["name"])
    except (OSError, ValueError, KeyError, ImportError, AttributeError):
        return None


def _keep_class(record: Path, cls: type) -> None:
    if not cls.__module__.startswith("transformers."):
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"module": cls.__module__, "name": cls.__qualname__}) + "\n")
        partial.replace(record)  # whole or not at all: replicas may load at once
    except OSError as err:  # a read-only cache: AutoTokenizer chooses again next time
        log.info("tokenizer class not kept in %s: %s", record.parent, err)
