"""The drafter as a Ray actor: loads the DFlash model and serves its verifier's channel."""

from __future__ import annotations

import torch

from dflash_serve.services.drafter.server import DrafterServer
from dflash_serve.services.engine.loader import resolve_dtype


class DrafterActor:
    def __init__(self, drafter_path: str, device: str, dtype: str, revision: str | None = None):
        """revision: the drafter's hub commit or tag (engine.drafter_revision)."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("the drafter actor was placed without a GPU; give it num_gpus or share the verifier's")
        self.server = DrafterServer.load(drafter_path, device=device, dtype=resolve_dtype(dtype, torch.device(device)),
                                         revision=revision)
        self.server.start()

    def address(self) -> tuple[str, int]:
        return self.server.address

    def stats(self) -> dict:
        return self.server.stats()
