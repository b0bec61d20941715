"""The verifier <-> drafter data plane on one node (protos/dflash/v1/drafter.proto).

Per step, one frame pair travels over a direct socket channel (`channel`); bulky tensors (feature
rows, the target's embedding and LM head) stay in buffers opened once and are only named in the
frames (`shared_buffer`: POSIX shared memory on CPU, CUDA IPC on GPU). Ray places the processes
but carries none of this.

Each name is imported on first use (PEP 562): a router's output streams use `channel` alone,
without the torch that `shared_buffer` imports.
"""

from dflash_serve.services.lazy_names import names_on_first_use

_MODULE_OF = {
    **dict.fromkeys(("BUSY_POLL_SECONDS", "DEFAULT_MAX_FRAME_BYTES", "ChannelClosed", "FrameChannel", "FrameError",
                     "FrameListener", "FrameTooLarge", "connect"), "channel"),
    **dict.fromkeys(("FeatureRing", "OpenedTensor", "OpenedWritesDone", "SharedTensor", "WritesDone", "open_shared",
                     "read_rows"), "shared_buffer"),
}
__all__ = sorted(_MODULE_OF)
__getattr__ = names_on_first_use(__name__, _MODULE_OF)
