"""The drafter as a Ray actor: loads the DFlash model and serves its verifier's channel."""

from __future__ import annotations

import os
from collections.abc import Sequence

# Set in the actor's runtime_env: Ray then leaves CUDA_VISIBLE_DEVICES to the actor even when it
# gives it a GPU (Ray 2.60, ray/_private/accelerators/nvidia_gpu.py), and `cuda_visibility` sets it.
RAY_NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def cuda_visibility(verifier_gpu_ids: Sequence[str], own_gpu_ids: Sequence[str], verifier_device: str
                    ) -> tuple[str, str]:
    """The drafter process's CUDA_VISIBLE_DEVICES and the device it computes on, from the GPU ids
    Ray gave its verifier and itself (`ray.get_gpu_ids()` of each). The verifier's GPUs come first,
    in its order, so the CUDA IPC handles it exports from its cuda:N open as cuda:N here too; the
    drafter computes on its own GPU after them, or where the verifier does (`verifier_device`,
    engine.device) when it has none."""
    if not verifier_gpu_ids:
        raise ValueError("the verifier has no GPU: a drafter on CUDA maps the verifier's GPU buffers, so the "
                         "verifier needs verifier_num_gpus > 0")
    visible = ",".join(str(gpu) for gpu in (*verifier_gpu_ids, *own_gpu_ids))
    return visible, f"cuda:{len(verifier_gpu_ids)}" if own_gpu_ids else verifier_device


class DrafterActor:
    def __init__(self, drafter_path: str, device: str, dtype: str, revision: str | None = None, *,
                 verifier_gpu_ids: Sequence[str] | None = None):
        """device: engine.device, where the verifier computes. revision: the drafter's hub commit or
        tag (engine.drafter_revision). verifier_gpu_ids: the verifier's `ray.get_gpu_ids()` when
        `device` is cuda; this process then sees those and its own GPU, if Ray gave it one, and
        computes there (`cuda_visibility`). None: it sees what it was started with."""
        # Imported here, not with the module: the verifier replica imports this module to spawn the
        # actor, and torch with the drafter's code took it 3.8 s before its engine process started.
        import torch

        from dflash_serve.services.drafter.server import DrafterServer
        from dflash_serve.services.engine.loader import resolve_dtype
        from dflash_serve.services.gc_freeze import freeze_startup_objects

        if verifier_gpu_ids is not None:
            import ray

            if torch.cuda.is_initialized():  # CUDA reads CUDA_VISIBLE_DEVICES once, when it starts
                raise RuntimeError("CUDA started in the drafter actor's process before it chose its GPUs")
            os.environ["CUDA_VISIBLE_DEVICES"], device = cuda_visibility(verifier_gpu_ids, ray.get_gpu_ids(), device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("the drafter actor was placed without a GPU; give it num_gpus or share the verifier's")
        self.server = DrafterServer.load(drafter_path, device=device, dtype=resolve_dtype(dtype, torch.device(device)),
                                         revision=revision)
        self.server.start()
        freeze_startup_objects()

    def address(self) -> tuple[str, int]:
        return self.server.address

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stats(self) -> dict:
        return self.server.stats()
