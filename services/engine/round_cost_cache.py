"""Round costs kept between starts: measured once per (model shapes, engine settings, machine).

The adaptive policy needs each round shape's cost before the first request (`RoundCosts`).
Measuring them took 15.4 s of a CPU replica's 36 s restart with the default pair (issue 66), at
every start of every replica. They depend only on the models' shapes, the engine's settings, the
device and the libraries, so a replica that finds them measured under the same key loads them
instead: a restarted replica, another replica of the same deployment (on Kubernetes, the models
volume they share), a second `dflash serve`. The policy corrects what the machine's state adds
online, from every round's wall time (`RoundCosts.observe_round`). A file that does not parse, or
a folder that cannot be written, costs a measurement and a warning, never a start.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
FORMAT = 1
# EngineConfig fields that name models (their shapes are in the key) or change no cost.
NOT_IN_KEY = frozenset({"target", "drafter", "target_revision", "drafter_revision", "round_costs_dir",
                        "max_tokens_limit"})


def model_shape(config: dict) -> dict:
    """A model's config.json without what names or dates it (where it was loaded from, versions)."""
    return {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}


def machine(device: torch.device) -> dict:
    """What a forward's time depends on besides the models and settings."""
    facts = {"torch": torch.__version__, "dflash_serve": _version("dflash-serve"), "triton": _version("triton")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(device=props.name, capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                     driver=_nvidia_driver(), memory_gib=round(props.total_memory / 2**30))
    else:
        facts.update(device=_cpu_name(), threads=torch.get_num_threads(), machine=platform.machine())
    return facts


class RoundCostCache:
    """One folder of measured round costs, a file per key (a hash of everything they depend on)."""

    def __init__(self, directory: Path, key: dict):
        self.directory = directory
        self.key = key

    def path(self, extra: dict) -> Path:
        text = json.dumps({"format": FORMAT, **self.key, **extra}, sort_keys=True, default=str)
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"

    def load(self, extra: dict) -> dict | None:
        """The measurement stored under this key and `extra`, or None."""
        path = self.path(extra)
        try:
            stored = json.loads(path.read_text())
            return stored["measured"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("round costs in %s unreadable (%s): measuring them again", path, err)
            return None

    def store(self, extra: dict, measured: dict) -> None:
        path = self.path(extra)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")  # replicas may write the same key at once
            partial.write_text(json.dumps({"key": {**self.key, **extra}, "measured": measured}, default=str))
            partial.replace(path)
        except OSError as err:
            log.warning("round costs not kept in %s (%s): the next start measures them again", self.directory, err)
            return
        log.info("round costs kept in %s", path)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _nvidia_driver() -> str:
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
