"""Tensors whose memory a second process on this node maps once, then reads and writes in place.

The owner allocates (or wraps) a `SharedTensor` and sends `describe()` to the peer, which maps it
with `open_shared`. On CPU the memory is a POSIX shared-memory segment; on CUDA it is the owner's
own allocation, exported through torch's CUDA IPC machinery. A `FeatureRing` hands out rows of a
shared [capacity, width] buffer by `KVBlockHandle`, so per-step frames carry offsets, not data.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import time
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory

import torch

from dflash_serve.services.api.dflash.v1 import drafter_pb2

# Where Linux keeps POSIX shared memory. Both sides map segments from here themselves (rather than
# through SharedMemory objects): the mapping then lives exactly as long as the tensors viewing it,
# and the peer never registers the owner's segment with its resource tracker, which would unlink
# it when the peer exits (Python 3.11/3.12).
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "dflash_"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, buffer_id: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared buffer {buffer_id!r} has unknown dtype {name!r}")
    return dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype, buffer_id: str) -> int:
    numel = 1
    for size in shape:
        numel *= size
    if numel <= 0:
        raise ValueError(f"shared buffer {buffer_id!r} has shape {list(shape)}: it must hold at least one element")
    return numel * dtype.itemsize


class SharedTensor:
    """The owner's side of a shared buffer. Keep it (and so the memory) alive, unclosed, for as
    long as any peer uses the buffer; `close()` ends the sharing."""

    def __init__(self, buffer_id: str, tensor: torch.Tensor, location: dict, release):
        self.buffer_id = buffer_id
        self._tensor = tensor
        self._location = location  # the SharedBuffer fields that say where the memory is
        self._release = release

    @classmethod
    def allocate(cls, buffer_id: str, shape, dtype: torch.dtype, device) -> SharedTensor:
        """A new uninitialised tensor another process can map."""
        device = torch.device(device)
        shape = tuple(int(s) for s in shape)
        if device.type == "cuda":
            return cls._export_cuda(buffer_id, torch.empty(shape, dtype=dtype, device=device))
        if device.type == "cpu":
            return cls._create_segment(buffer_id, shape, dtype)
        raise ValueError(f"shared buffer {buffer_id!r}: cannot share memory of device {device}")

    @classmethod
    def wrap(cls, buffer_id: str, tensor: torch.Tensor) -> SharedTensor:
        """Share an existing tensor: a CUDA tensor in place (no copy), a CPU one by copying it into
        shared memory once."""
        if tensor.is_cuda:
            if not tensor.is_contiguous():
                raise ValueError(f"shared buffer {buffer_id!r}: only a contiguous CUDA tensor can be shared in place")
            return cls._export_cuda(buffer_id, tensor)
        shared = cls.allocate(buffer_id, tensor.shape, tensor.dtype, "cpu")
        shared.tensor.copy_(tensor)
        return shared

    @classmethod
    def _create_segment(cls, buffer_id: str, shape: tuple[int, ...], dtype: torch.dtype) -> SharedTensor:
        nbytes = _nbytes(shape, dtype, buffer_id)
        # tmpfs pages are allocated on first touch: a segment larger than what is free would be
        # created fine and then kill the process with SIGBUS. Containers default to a 64 MiB /dev/shm.
        fs = os.statvfs(SHM_DIR)
        free = fs.f_bavail * fs.f_frsize
        if nbytes > free:
            raise MemoryError(
                f"shared buffer {buffer_id!r} needs {nbytes / 2**20:.1f} MiB but {SHM_DIR} has "
                f"{free / 2**20:.1f} MiB free: enlarge it (Kubernetes: an emptyDir with medium Memory)")
        safe_id = re.sub(r"[^A-Za-z0-9]", "-", buffer_id)[:32]
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{safe_id}_{secrets.token_hex(6)}"
        # SharedMemory creates the segment exclusively and registers it with the resource tracker,
        # which unlinks it should this process die without closing it.
        segment = SharedMemory(name=name, create=True, size=nbytes)
        segment.close()
        tensor = _map_segment(name, 0, shape, dtype, buffer_id)
        return cls(buffer_id, tensor, {"shm_name": name, "storage_offset": 0}, segment.unlink)

    @classmethod
    def _export_cuda(cls, buffer_id: str, tensor: torch.Tensor) -> SharedTensor:
        # What the peer maps must already be there (wrap: weights whose loading may still be queued).
        torch.cuda.current_stream(tensor.device).synchronize()
        # torch hands out the IPC handle of the whole cudaMalloc block holding this storage, and the
        # storage's offset in it. The handle's ref counter, event and the sent-data bookkeeping
        # stay here: the peer gets what it needs to map the memory and nothing to give back.
        (_device, handle, _storage_bytes, storage_offset_bytes,
         ref_counter, ref_counter_offset, _event, _event_sync) = tensor.untyped_storage()._share_cuda_()
        offset = storage_offset_bytes + tensor.storage_offset() * tensor.element_size()

        def release():
            # torch counts one consumer per export and keeps the block out of the allocator
            # ("limbo") until that consumer says it is done. Our peer never says so, so the owner
            # does it on close: the memory is then freed (or reused) normally.
            torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, ref_counter_offset)

        return cls(buffer_id, tensor, {"cuda_ipc_handle": handle, "storage_offset": offset}, release)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"shared buffer {self.buffer_id!r} is closed")
        return self._tensor

    def describe(self) -> drafter_pb2.SharedBuffer:
        tensor = self.tensor
        return drafter_pb2.SharedBuffer(
            buffer_id=self.buffer_id, shape=list(tensor.shape), dtype=dtype_name(tensor.dtype),
            device=tensor.device.index if tensor.is_cuda else -1, **self._location)

    def unlink_name(self) -> None:
        """Once every peer has mapped a CPU buffer, remove its name from /dev/shm: the memory lives
        on in the mappings until the last is gone, and nothing is left behind however the
        processes end (SIGKILL included). Peers can no longer open it. A CUDA buffer has no name."""
        if "shm_name" in self._location and self._tensor is not None:
            self._release()
            self._release = lambda: None

    def close(self) -> None:
        """Stop sharing: a CPU segment is unlinked (mappings already made stay valid until their
        last view is freed); a CUDA allocation goes back to its owner's allocator once unused here.
        Peers must be done with the buffer first."""
        if self._tensor is None:
            return
        self._release()  # first: a CUDA block freed while torch still counts a consumer stays in limbo
        self._tensor = None


class OpenedTensor:
    """The peer's side of a shared buffer: `tensor` views the owner's memory."""

    def __init__(self, buffer_id: str, tensor: torch.Tensor):
        self.buffer_id = buffer_id
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"shared buffer {self.buffer_id!r} is closed")
        return self._tensor

    def close(self) -> None:
        """Drop this handle's view; the mapping goes when the last view of it is freed."""
        self._tensor = None


def open_shared(desc: drafter_pb2.SharedBuffer) -> OpenedTensor:
    """Map a buffer another process on this node shares. Opening is slow (a CUDA IPC handle takes
    up to hundreds of ms): open once per session and keep the result."""
    buffer_id = desc.buffer_id
    dtype = parse_dtype(desc.dtype, buffer_id)
    shape = tuple(desc.shape)
    location = desc.WhichOneof("location")
    if location == "shm_name":
        return OpenedTensor(buffer_id, _map_segment(desc.shm_name, desc.storage_offset, shape, dtype, buffer_id))
    if location == "cuda_ipc_handle":
        return OpenedTensor(buffer_id, _open_cuda(desc, shape, dtype))
    raise ValueError(f"shared buffer {buffer_id!r} names neither a shared-memory segment nor a CUDA IPC handle")


def _map_segment(name: str, offset: int, shape: tuple[int, ...], dtype: torch.dtype, buffer_id: str) -> torch.Tensor:
    nbytes = _nbytes(shape, dtype, buffer_id)
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared buffer {buffer_id!r}: segment {name!r} does not exist in {SHM_DIR} (its owner "
            "closed it, or the owner runs on another host or in another IPC namespace)") from None
    try:
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise ValueError(f"shared buffer {buffer_id!r}: {list(shape)} {dtype_name(dtype)} at byte {offset} "
                             f"needs {offset + nbytes} bytes, segment {name!r} has {size}")
        mapping = mmap.mmap(fd, offset + nbytes)
    finally:
        os.close(fd)
    # The tensor holds the mapping alive; nothing else refers to it.
    return torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)


def _open_cuda(desc: drafter_pb2.SharedBuffer, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    buffer_id = desc.buffer_id
    if not torch.cuda.is_available():
        raise RuntimeError(f"shared buffer {buffer_id!r} is a CUDA IPC handle, but this process sees no CUDA device")
    if not 0 <= desc.device < torch.cuda.device_count():
        raise RuntimeError(
            f"shared buffer {buffer_id!r} lives on cuda:{desc.device}, but this process sees "
            f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES differs between the processes?)")
    torch.cuda.init()
    nbytes = _nbytes(shape, dtype, buffer_id)
    # As torch.multiprocessing's rebuild_cuda_tensor does, minus the producer's ref counter and
    # event: the owner keeps the memory alive until close() and completes its writes before it
    # names them (see FeatureRing.write), so there is nothing to count or wait for.
    storage = torch.UntypedStorage._new_shared_cuda(
        desc.device, desc.cuda_ipc_handle, nbytes, desc.storage_offset, b"", 0, b"", False)
    return torch.empty(0, dtype=dtype, device=torch.device("cuda", desc.device)).set_(storage, 0, shape)


class FeatureRing:
    """Rows written one block after another into a shared [capacity, width] buffer, wrapping to
    row 0 when a block does not fit before the end; each block is named by a `KVBlockHandle`.

    One writer; the peer reads a block before it answers the step that named it (on CUDA, once
    the owner's `WritesDone` says the copy in is done), and the owner
    waits for that answer, so no locks. A writer that sends several blocks before reading the
    answers must not lap the peer: `can_write` says whether a block would overwrite unread rows,
    `mark_read` says the peer has answered every block so far (or every block written before
    `written` had a given value: the peer answers steps in order).
    """

    def __init__(self, shared: SharedTensor):
        if shared.tensor.dim() != 2:
            raise ValueError(f"a feature ring needs a [rows, width] buffer; {shared.buffer_id!r} "
                             f"has shape {list(shared.tensor.shape)}")
        self.shared = shared
        self.capacity, self.width = shared.tensor.shape
        self._next_row = 0
        self.written = 0  # rows written since the start, skipped tails included
        self._read = 0  # of those, the rows the peer has answered for: the unread ones are one span up to _next_row

    def _placement(self, n: int) -> tuple[int, int]:
        """Where a block of n rows starts, and how many tail rows it skips by wrapping."""
        if n > self.capacity:
            raise ValueError(f"cannot write {n} rows into feature ring {self.shared.buffer_id!r} "
                             f"of {self.capacity} rows")
        if self._next_row + n <= self.capacity:
            return self._next_row, 0
        return 0, self.capacity - self._next_row

    def can_write(self, n: int) -> bool:
        """Whether `write` of n rows now leaves every row the peer has not read intact."""
        _, skipped = self._placement(n)
        unread = self.written - self._read
        return not unread or unread + skipped + n <= self.capacity

    def mark_read(self, written: int | None = None) -> None:
        """The peer has answered every step whose rows were written so far, or before `written`
        (the value of `written` when the last step it answered was sent)."""
        self._read = self.written if written is None else max(self._read, written)

    def write(self, rows: torch.Tensor) -> drafter_pb2.KVBlockHandle:
        """Copy rows [n, width] in and return their handle. On CUDA the copy is only queued: record
        a `WritesDone` after it and before the handle leaves."""
        if rows.dim() != 2 or rows.shape[1] != self.width:
            raise ValueError(f"feature ring {self.shared.buffer_id!r} holds rows of width {self.width}, "
                             f"got shape {list(rows.shape)}")
        n = rows.shape[0]
        start, skipped = self._placement(n)
        if n:
            self.shared.tensor[start:start + n].copy_(rows)
        # A wrap skips the tail rows; counting them as unread keeps the unread rows one span
        # (unless none are unread: then the skipped rows are read as well).
        if self._read == self.written:
            self._read += skipped
        self.written += skipped + n
        self._next_row = start + n
        return drafter_pb2.KVBlockHandle(buffer_id=self.shared.buffer_id, row_offset=start, rows=n)


def read_rows(buffer: OpenedTensor | torch.Tensor, handle: drafter_pb2.KVBlockHandle) -> torch.Tensor:
    """The rows `handle` names, as a view of the mapped buffer (no copy). The owner may overwrite
    them once this step is answered: finish using them (on CUDA: synchronize) before replying."""
    if isinstance(buffer, OpenedTensor):
        if handle.buffer_id != buffer.buffer_id:
            raise ValueError(f"handle names buffer {handle.buffer_id!r}, not {buffer.buffer_id!r}")
        buffer = buffer.tensor
    end = handle.row_offset + handle.rows
    if end > buffer.shape[0]:
        raise ValueError(f"handle names rows [{handle.row_offset}, {end}) of {handle.buffer_id!r}, "
                         f"which has {buffer.shape[0]} rows")
    return buffer[handle.row_offset:end]


class WritesDone:
    """Tells a peer process that the GPU writes this process has queued to shared buffers are
    done, without this host waiting for them: an interprocess CUDA event recorded after the
    writes and before the frame that names them. The peer waits for it on its host
    (`OpenedWritesDone.wait`), not on a stream: should this process die first, a peer stream
    waiting on its event would stay blocked for good. On CPU a write is done when it returns,
    so there is nothing to record or wait for (`handle` is empty).

    The event belongs to `device` and is recorded on that device's current stream, whichever
    device this thread is on (a drafter on its own GPU signals writes into its verifier's memory)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.event = None
        if self.device.type == "cuda":
            self.event = torch.cuda.Event(interprocess=True)
            self.event.record(torch.cuda.current_stream(self.device))  # creates it on `device`; nothing to wait for

    @property
    def handle(self) -> bytes:
        return b"" if self.event is None else bytes(self.event.ipc_handle())

    def record(self) -> None:
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))


class OpenedWritesDone:
    """The peer's side of a `WritesDone`."""

    def __init__(self, handle: bytes, device: torch.device):
        self.event = torch.cuda.Event.from_ipc_handle(device, handle) if handle else None

    def wait(self, timeout: float, *, owner_alive: Callable[[], bool] | None = None) -> float:
        """Return once the owner's writes recorded so far are done (busy-polling: the next kernels
        should start the moment they are); the seconds waited. TimeoutError after `timeout`;
        ConnectionError as soon as `owner_alive` (asked every 10 ms) says the owner is gone, whose
        event may then never complete."""
        if self.event is None:
            return 0.0
        t0 = time.perf_counter()
        deadline, next_check = t0 + timeout, t0 + 0.01
        while not self.event.query():
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"the peer's shared-buffer writes were not done within {timeout} s")
            if owner_alive is not None and now > next_check:
                if not owner_alive():
                    raise ConnectionError("the peer went away before its shared-buffer writes were done")
                next_check = now + 0.01
        return time.perf_counter() - t0
