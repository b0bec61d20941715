"""The verifier <-> drafter data plane on one node (protos/dflash/v1/drafter.proto).

Per step, one frame pair travels over a direct socket channel (`channel`); bulky tensors (feature
rows, the target's embedding and LM head) stay in buffers opened once and are only named in the
frames (`shared_buffer`: POSIX shared memory on CPU, CUDA IPC on GPU). Ray places the processes
but carries none of this.
"""

from dflash_serve.services.transport.channel import (
    BUSY_POLL_SECONDS,
    DEFAULT_MAX_FRAME_BYTES,
    ChannelClosed,
    FrameChannel,
    FrameError,
    FrameListener,
    FrameTooLarge,
    connect,
)
from dflash_serve.services.transport.shared_buffer import (
    FeatureRing,
    OpenedTensor,
    OpenedWritesDone,
    SharedTensor,
    WritesDone,
    open_shared,
    read_rows,
)

__all__ = [
    "BUSY_POLL_SECONDS",
    "DEFAULT_MAX_FRAME_BYTES",
    "ChannelClosed",
    "FeatureRing",
    "FrameChannel",
    "FrameError",
    "FrameListener",
    "FrameTooLarge",
    "OpenedTensor",
    "OpenedWritesDone",
    "SharedTensor",
    "WritesDone",
    "connect",
    "open_shared",
    "read_rows",
]
