"""Flags generated from the config: one for every field of EngineConfig and ServeConfig
(services/config.py), its help the field's description and default, and what the commands share
of reading them back (`given_config_flags`, `model_pair`)."""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib.metadata
import sys
import types
import typing

from pydantic import BaseModel

from dflash_serve.services.config import EngineConfig, environment

# Flags that predate the generated ones: both spellings stay.
ALIASES = {"cuda_graphs": ("--eager", "no CUDA graphs: the same as --no-cuda-graphs"),
           "async_scheduling": ("--sync-rounds", "wait for each round's results before launching the next: the "
                                                 "same as --no-async-scheduling")}


def auto_device() -> str:
    """cuda where torch is a CUDA build and the driver sees a device, else cpu (`cuda_device_count`)."""
    return "cuda" if cuda_device_count() > 0 else "cpu"


def cuda_device_count() -> int:
    """The GPUs torch would see: told without importing torch where it is not imported yet (1.5-5 s
    of every command's start, `dflash serve`'s included, whose engine runs in other processes)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.device_count()
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return 0
        cuda = ctypes.CDLL("libcuda.so.1")
    except (importlib.metadata.PackageNotFoundError, OSError):
        return 0
    count = ctypes.c_int(0)
    # As torch asks: the driver's device count, CUDA_VISIBLE_DEVICES applied.
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _drafter_flag(value: str) -> str | None:
    """`--drafter none`: target-only, the config's null."""
    from dflash_serve.services.models.default_pair import NO_DRAFTER

    return None if value == NO_DRAFTER else value


def _mapping_flag(value: str) -> dict:
    """A mapping flag, written as in the help: `{1: 15, 8: 7, 32: 0}` (or JSON); the config
    validates its keys and values."""
    try:
        mapping = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        mapping = None
    if not isinstance(mapping, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping such as {{1: 15, 8: 7, 32: 0}}, got {value!r}")
    return mapping


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str,
                     helps: dict[str, str] | None = None, defaults: dict[str, str] | None = None) -> None:
    """A flag for every field of `model` (`max_num_seqs` -> `--max-num-seqs`; booleans also as
    `--no-...`), its help the field's description and default. A flag left out sets nothing
    (argparse.SUPPRESS), so the environment, the config file and the defaults below it apply:
    `given_config_flags` reads back the ones given. `helps` replaces a field's description,
    `defaults` names a default the command picks itself (`helps` say their own)."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue  # ServeConfig.engine: its fields get their own group
        shown = (defaults or {}).get(name, repr(field.get_default(call_default_factory=True)))
        help_text = (helps or {}).get(name) or f"{field.description} (default: {shown})"
        options = dict(dest=name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        kinds = [kind for kind in typing.get_args(field.annotation) if kind is not type(None)] \
            if isinstance(field.annotation, types.UnionType) else [field.annotation]
        if kinds == [bool]:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kinds[0]) is typing.Literal:
            options["choices"] = typing.get_args(kinds[0])
        elif name == "drafter":
            options["type"] = _drafter_flag
        elif typing.get_origin(kinds[0]) is dict:
            options["type"] = _mapping_flag
        else:
            options["type"] = kinds[0]
        group.add_argument("--" + name.replace("_", "-"), **options)
        if name in ALIASES:
            flag, help_text = ALIASES[name]
            group.add_argument(flag, dest=name, action="store_const", const=False, default=argparse.SUPPRESS,
                               help=help_text)


def given_config_flags(args: argparse.Namespace, model: type[BaseModel]) -> dict:
    """The fields of `model` given on the command line (those left out are absent)."""
    return {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}


def model_pair(flags: dict) -> dict:
    """target and drafter as given by the flags or, under them, DFLASH_ENGINE__TARGET/DRAFTER,
    with the default pair filling in as resolve_pair does (neither given: the default pair)."""
    from dflash_serve.services.models.default_pair import NO_DRAFTER, resolve_pair

    given = {**environment().get("engine", {}), **flags}
    drafter = NO_DRAFTER if "drafter" in given and given["drafter"] is None else given.get("drafter")
    target, drafter = resolve_pair(given.get("target"), drafter)
    return {"target": target, "drafter": drafter}


ENGINE_FLAGS_TITLE = "EngineConfig; flags > DFLASH_ENGINE__* > defaults"
MODEL_PAIR_HELP = {
    "target": "The target model: a folder or a hub repo id (omit both --target and --drafter: the default pair, "
              "SmolLM2-135M-Instruct and its drafter).",
    "drafter": "The DFlash drafter: a folder or a hub repo id; 'none': target-only (omitted: the default drafter "
               "without --target, target-only with it).",
}
COMMAND_DEFAULTS = {"device": "cuda when there is a GPU, else cpu"}


def add_engine_flags(parser: argparse.ArgumentParser, title: str = ENGINE_FLAGS_TITLE,
                     defaults: dict[str, str] | None = None) -> None:
    """EngineConfig's flags as the commands that build an engine show them: the model pair's help,
    and the defaults a command picks itself (the device, and what `defaults` adds)."""
    add_config_flags(parser, EngineConfig, title, helps=MODEL_PAIR_HELP,
                     defaults={**COMMAND_DEFAULTS, **(defaults or {})})
