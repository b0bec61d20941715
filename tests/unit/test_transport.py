"""dflash_serve.services.transport across real processes: shared buffers (CPU shm; CUDA IPC where a GPU is
present), the feature ring, and the frame channel, including peers that die or send garbage."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from multiprocessing import resource_tracker

import pytest
import torch

from dflash_serve.services.api.dflash.v1 import drafter_pb2
from dflash_serve.services.transport import (
    ChannelClosed,
    FeatureRing,
    FrameError,
    FrameListener,
    FrameTooLarge,
    OpenedWritesDone,
    SharedTensor,
    WritesDone,
    connect,
    open_shared,
    read_rows,
)
from dflash_serve.services.transport.channel import HEADER
from dflash_serve.services.transport.shared_buffer import SEGMENT_PREFIX, SHM_DIR

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- the peer process -----------------------------------------------------------------------------

def _peer_main(conn) -> None:
    """Runs in a spawned process: the peer's side of the transport, one command at a time."""
    opened = {}
    channels = []

    def open_buffer(desc: bytes):
        buffer = open_shared(drafter_pb2.SharedBuffer.FromString(desc))
        opened[buffer.buffer_id] = buffer
        return list(buffer.tensor.shape)

    def read(buffer_id: str):
        return opened[buffer_id].tensor.float().cpu().tolist()

    def write(buffer_id: str, row: int, value: float):
        tensor = opened[buffer_id].tensor
        tensor[row].fill_(value)
        if tensor.is_cuda:
            torch.cuda.synchronize()

    def rows(buffer_id: str, handle: bytes, writes_done: bytes = b""):
        OpenedWritesDone(writes_done, opened[buffer_id].tensor.device).wait(timeout=10)
        return read_rows(opened[buffer_id], drafter_pb2.KVBlockHandle.FromString(handle)).float().cpu().tolist()

    def close(buffer_id: str):
        opened.pop(buffer_id).close()

    def echo(address):
        """Answer each StepRequest with its positions (as text: any field that carries them will
        do) until the verifier hangs up."""
        channel = connect(address, timeout=10)
        answered = 0
        while True:
            try:
                request = channel.recv(drafter_pb2.DrafterRequest)
            except ChannelClosed:
                return answered
            step = drafter_pb2.StepResult(step=request.step.step, error=" ".join(map(str, request.step.positions)))
            channel.send(drafter_pb2.DrafterReply(step=step))
            answered += 1

    def hold(address, count: int):
        channels.extend(connect(address, timeout=10) for _ in range(count))

    def record_late(seconds: float):
        """A WritesDone recorded behind a kernel that runs for `seconds`; its handle."""
        writes_done = WritesDone(torch.device("cuda"))
        torch.cuda._sleep(int(seconds * 2e9))  # GPU clock cycles
        writes_done.record()
        channels.append(writes_done)  # kept alive
        return writes_done.handle

    commands = {"open": open_buffer, "read": read, "write": write, "rows": rows, "close": close,
                "echo": echo, "hold": hold, "record_late": record_late}
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, commands[command](*args)))
        except Exception as err:  # noqa: BLE001 - reported to the test, which asserts on it
            conn.send((False, f"{type(err).__name__}: {err}"))


class PeerFailed(RuntimeError):
    pass


class Peer:
    """A spawned process running `_peer_main`; call it like a function."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child_conn,), daemon=True)
        self.process.start()
        child_conn.close()

    def start(self, command: str, *args) -> None:
        self._conn.send((command, args))

    def result(self, timeout: float = 60):
        if not self._conn.poll(timeout):
            raise TimeoutError("the peer process did not answer")
        ok, value = self._conn.recv()
        if not ok:
            raise PeerFailed(value)
        return value

    def __call__(self, command: str, *args):
        self.start(command, *args)
        return self.result()

    def stop(self) -> None:
        self._conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(scope="module")
def peer():
    process = Peer()
    yield process
    process.stop()


@pytest.fixture
def doomed_peer():
    process = Peer()
    yield process
    process.stop()


def _segments() -> set[str]:
    """This process's segments (their names carry its pid): another pytest-xdist worker's tests
    create and unlink their own meanwhile."""
    own = f"{SEGMENT_PREFIX}{os.getpid()}_"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(own)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = _segments()
    yield
    assert _segments() - before == set()


# -- shared buffers on CPU ------------------------------------------------------------------------

def test_cpu_buffer_is_shared_both_ways_and_close_unlinks_it(peer):
    values = torch.arange(24, dtype=torch.float32).view(4, 6)
    owner = SharedTensor.wrap("weights", values)
    desc = owner.describe()
    assert desc.WhichOneof("location") == "shm_name" and desc.device == -1 and desc.dtype == "float32"
    assert desc.shm_name in _segments()

    assert peer("open", desc.SerializeToString()) == [4, 6]
    assert peer("read", "weights") == values.tolist()
    owner.tensor[1].fill_(7.0)
    assert peer("read", "weights")[1] == [7.0] * 6
    peer("write", "weights", 2, -3.0)
    assert owner.tensor[2].tolist() == [-3.0] * 6
    peer("close", "weights")
    assert desc.shm_name in _segments()  # the peer closing does not remove the owner's segment

    owner.close()
    assert desc.shm_name not in _segments()
    with pytest.raises(ValueError, match="'weights' is closed"):
        owner.tensor
    with pytest.raises(FileNotFoundError, match="segment .* does not exist"):
        open_shared(desc)
    with pytest.raises(PeerFailed, match="does not exist"):
        peer("open", desc.SerializeToString())


def test_an_unlinked_name_leaves_the_shared_memory_working_and_nothing_in_dev_shm(peer):
    owner = SharedTensor.wrap("weights", torch.zeros(2, 3))
    desc = owner.describe()
    peer("open", desc.SerializeToString())
    owner.unlink_name()
    assert desc.shm_name not in _segments()
    owner.tensor[0].fill_(5.0)
    assert peer("read", "weights")[0] == [5.0] * 3  # both mappings still see one memory
    peer("write", "weights", 1, 2.0)
    assert owner.tensor[1].tolist() == [2.0] * 3
    with pytest.raises(PeerFailed, match="does not exist"):
        peer("open", desc.SerializeToString())  # nobody new can open it
    peer("close", "weights")
    owner.close()  # nothing left to unlink: no error


def test_opening_registers_nothing_with_the_resource_tracker(monkeypatch):
    """Python 3.11/3.12 unlink every segment a process registered when it exits: the owner's."""
    owner = SharedTensor.allocate("features", (3, 5), torch.bfloat16, "cpu")
    registered = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: registered.append((name, rtype)))
    opened = open_shared(owner.describe())
    opened.tensor.fill_(1.5)
    assert registered == []
    assert owner.tensor.sum().item() == 1.5 * 15
    opened.close()
    owner.close()


def test_views_outlive_close_and_the_segment_does_not():
    owner = SharedTensor.allocate("ring", (2, 2), torch.float32, "cpu")
    opened = open_shared(owner.describe())
    view, owner_view = opened.tensor, owner.tensor
    opened.close()
    owner.close()
    owner_view.fill_(4.0)  # mappings stay valid until their last view goes
    assert view.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    with pytest.raises(ValueError, match="'ring' is closed"):
        opened.tensor


def test_bad_descriptions_are_refused_clearly():
    owner = SharedTensor.allocate("lm_head", (4, 4), torch.float16, "cpu")
    good = owner.describe()

    def bad(**changes) -> drafter_pb2.SharedBuffer:
        desc = drafter_pb2.SharedBuffer()
        desc.CopyFrom(good)
        for field, value in changes.items():
            if field == "shape":
                desc.shape[:] = value
            else:
                setattr(desc, field, value)
        return desc

    try:
        with pytest.raises(ValueError, match="'lm_head' has unknown dtype 'float13'"):
            open_shared(bad(dtype="float13"))
        no_location = bad()
        no_location.ClearField("location")
        with pytest.raises(ValueError, match="neither a shared-memory segment nor a CUDA IPC handle"):
            open_shared(no_location)
        with pytest.raises(ValueError, match="needs 40 bytes, segment .* has 32"):
            open_shared(bad(shape=[4, 5]))
        with pytest.raises(ValueError, match="at least one element"):
            open_shared(bad(shape=[0, 4]))
    finally:
        owner.close()
    with pytest.raises(ValueError, match="cannot share memory of device meta"):
        SharedTensor.allocate("x", (1,), torch.float32, "meta")


def test_too_little_dev_shm_is_an_error_not_a_sigbus(monkeypatch):
    real = os.statvfs(SHM_DIR)
    tiny = os.statvfs_result((real.f_bsize, 4096, 16, 16, 16) + tuple(real)[5:])  # 64 KiB free
    monkeypatch.setattr(os, "statvfs", lambda path: tiny)
    with pytest.raises(MemoryError, match=r"needs 1\.0 MiB but /dev/shm has 0\.1 MiB free"):
        SharedTensor.allocate("embedding", (1024, 256), torch.float32, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_handle_without_cuda_is_refused():
    desc = drafter_pb2.SharedBuffer(buffer_id="features", cuda_ipc_handle=bytes(64), shape=[2, 2],
                                    dtype="bfloat16", device=0)
    with pytest.raises(RuntimeError, match="'features' is a CUDA IPC handle, but this process sees no CUDA device"):
        open_shared(desc)


# -- the feature ring -----------------------------------------------------------------------------

def _rows(n: int, width: int, first: float) -> torch.Tensor:
    return torch.arange(first, first + n * width, dtype=torch.float32).view(n, width)


def test_feature_ring_places_blocks_and_wraps():
    shared = SharedTensor.allocate("features", (10, 3), torch.float32, "cpu")
    ring = FeatureRing(shared)
    try:
        placed = []
        for n in (4, 5, 3, 7, 10, 0):
            block = _rows(n, 3, first=100 * len(placed))
            handle = ring.write(block)
            assert handle.buffer_id == "features" and handle.rows == n
            assert torch.equal(read_rows(shared.tensor, handle), block)
            placed.append(handle.row_offset)
        assert placed == [0, 4, 0, 3, 0, 10]  # 3 rows do not fit after row 9: they start at 0

        with pytest.raises(ValueError, match="cannot write 11 rows into feature ring 'features' of 10 rows"):
            ring.write(_rows(11, 3, 0))
        with pytest.raises(ValueError, match="rows of width 3, got shape \\[2, 4\\]"):
            ring.write(torch.zeros(2, 4))
        beyond = drafter_pb2.KVBlockHandle(buffer_id="features", row_offset=8, rows=3)
        with pytest.raises(ValueError, match=r"rows \[8, 11\) of 'features', which has 10 rows"):
            read_rows(shared.tensor, beyond)
        flat = SharedTensor.wrap("flat", torch.zeros(4))
        with pytest.raises(ValueError, match="a feature ring needs a \\[rows, width\\] buffer"):
            FeatureRing(flat)
        flat.close()
    finally:
        shared.close()


def test_feature_ring_says_when_a_block_would_overwrite_unread_rows():
    shared = SharedTensor.allocate("features", (10, 1), torch.float32, "cpu")
    ring = FeatureRing(shared)
    try:
        ring.write(torch.zeros(4, 1))
        ring.mark_read()
        ring.write(torch.zeros(5, 1))  # rows 4..8 unread
        # 5 + 5 <= 10 rows, yet the block wraps to row 0 and would land on unread row 4.
        assert not ring.can_write(5)
        assert ring.can_write(4)  # rows 0..3
        ring.mark_read()
        assert ring.can_write(10)
        with pytest.raises(ValueError, match="cannot write 11 rows"):
            ring.can_write(11)
    finally:
        shared.close()


def test_feature_ring_rows_read_in_another_process(peer):
    shared = SharedTensor.allocate("features", (8, 4), torch.float32, "cpu")
    ring = FeatureRing(shared)
    try:
        peer("open", shared.describe().SerializeToString())
        for n, first in ((3, 0.0), (4, 50.0), (2, 90.0), (8, 200.0)):  # the third block wraps
            block = _rows(n, 4, first)
            handle = ring.write(block)
            assert peer("rows", "features", handle.SerializeToString()) == block.tolist()
        wrong = drafter_pb2.KVBlockHandle(buffer_id="embedding", row_offset=0, rows=1)
        with pytest.raises(PeerFailed, match="handle names buffer 'embedding', not 'features'"):
            peer("rows", "features", wrong.SerializeToString())
        peer("close", "features")
    finally:
        shared.close()


# -- the frame channel ----------------------------------------------------------------------------

def _step(step: int, positions) -> drafter_pb2.DrafterRequest:
    return drafter_pb2.DrafterRequest(step=drafter_pb2.StepRequest(step=step, positions=positions))


@pytest.fixture
def listener():
    frames = FrameListener()
    yield frames
    frames.close()


def test_frames_of_several_sizes_round_trip_between_processes(peer, listener):
    peer.start("echo", listener.address)
    channel = listener.accept(timeout=30)
    try:
        sizes = [0, 1, 100, 10_000, 400_000]  # the largest frame is ~2 MB: many partial reads
        for step, size in enumerate(sizes):
            positions = [i * 7919 for i in range(size)]
            channel.send(_step(step, positions))
            reply = channel.recv(drafter_pb2.DrafterReply, timeout=30)
            assert reply.step.step == step and reply.step.error.split() == [str(p) for p in positions]
        for step in range(10):  # several frames in flight before the first reply is read
            channel.send(_step(step, [step] * step))
        for step in range(10):
            assert channel.recv(drafter_pb2.DrafterReply, timeout=30).step.error.split() == [str(step)] * step
    finally:
        channel.close()
    assert peer.result() == len(sizes) + 10


def test_a_killed_peer_closes_the_channel_on_send_and_on_recv(doomed_peer, listener):
    doomed_peer.start("hold", listener.address, 2)
    sending, receiving = listener.accept(timeout=30), listener.accept(timeout=30)
    doomed_peer.result()
    doomed_peer.process.kill()
    doomed_peer.process.join()

    assert sending.peer_hung_up() and receiving.peer_hung_up()
    start = time.monotonic()
    with pytest.raises(ChannelClosed, match="the peer closed the channel"):
        sending.send(_step(1, [1, 2, 3]))
    with pytest.raises(ChannelClosed, match="the peer closed the channel"):
        receiving.recv(drafter_pb2.DrafterReply, timeout=5)
    assert time.monotonic() - start < 1.0
    with pytest.raises(ChannelClosed, match="is closed"):
        receiving.send(_step(2, []))


def _raw_pair(listener):
    """A FrameChannel whose peer is a bare socket, to send what no FrameChannel would."""
    raw = socket.create_connection(listener.address)
    return raw, listener.accept(timeout=5)


def test_recv_timeout_keeps_partial_frames_and_the_channel(listener):
    raw, channel = _raw_pair(listener)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="0 bytes of an unfinished frame"):
            channel.recv(drafter_pb2.DrafterRequest, timeout=0.2)
        assert 0.15 < time.monotonic() - start < 1.0

        payload = _step(5, list(range(50))).SerializeToString()
        frame = HEADER.pack(len(payload)) + payload
        raw.sendall(frame[:30])
        with pytest.raises(TimeoutError, match="30 bytes of an unfinished frame"):
            channel.recv(drafter_pb2.DrafterRequest, timeout=0.2)
        raw.sendall(frame[30:])
        assert list(channel.recv(drafter_pb2.DrafterRequest, timeout=1).step.positions) == list(range(50))
    finally:
        raw.close()
        channel.close()


def test_busy_poll_receives_during_and_after_the_spin_and_keeps_timeouts(listener):
    raw, channel = _raw_pair(listener)
    try:
        payload = _step(1, [4, 5]).SerializeToString()
        later = threading.Timer(0.05, raw.sendall, [HEADER.pack(len(payload)) + payload])
        later.start()  # arrives while the recv still spins
        assert list(channel.recv(drafter_pb2.DrafterRequest, timeout=5, busy_poll=1.0).step.positions) == [4, 5]
        later = threading.Timer(0.3, raw.sendall, [HEADER.pack(len(payload)) + payload])
        later.start()  # arrives once the recv has given up spinning and blocks
        assert channel.recv(drafter_pb2.DrafterRequest, timeout=5, busy_poll=0.05).step.step == 1

        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no complete frame"):
            channel.recv(drafter_pb2.DrafterRequest, timeout=0.2, busy_poll=10.0)  # the timeout bounds the spin
        assert time.monotonic() - start < 1.0

        threading.Timer(0.05, raw.close).start()
        start = time.monotonic()
        with pytest.raises(ChannelClosed, match="the peer closed the channel"):
            channel.recv(drafter_pb2.DrafterRequest, busy_poll=10.0)  # a hang-up ends the spin at once
        assert time.monotonic() - start < 1.0
    finally:
        raw.close()
        channel.close()


def test_oversized_frames_are_refused_on_both_sides():
    listener = FrameListener(max_frame_bytes=100)
    sender = connect(listener.address, timeout=5, max_frame_bytes=100)
    receiver = listener.accept(timeout=5)
    try:
        with pytest.raises(FrameTooLarge, match=r"DrafterRequest serializes to 2\d\d bytes, over this channel's limit of 100"):
            sender.send(_step(1, list(range(200))))
        sender.send(_step(2, [7]))  # nothing of the refused frame was sent
        assert receiver.recv(drafter_pb2.DrafterRequest, timeout=1).step.positions == [7]

        sender.max_frame_bytes = 1000  # a sender with a larger limit than its receiver
        sender.send(_step(3, list(range(200))))
        with pytest.raises(FrameError, match="announced a frame of 2\\d\\d bytes, over this channel's limit of 100"):
            receiver.recv(drafter_pb2.DrafterRequest, timeout=1)
        with pytest.raises(ChannelClosed, match="is closed"):
            receiver.recv(drafter_pb2.DrafterRequest, timeout=1)
    finally:
        sender.close()
        receiver.close()
        listener.close()


def test_garbage_from_the_peer_is_a_frame_error(listener):
    raw, channel = _raw_pair(listener)
    raw.sendall(b"\xff\xff\xff\xffGET / HTTP/1.1\r\n")
    with pytest.raises(FrameError, match="frame of 4294967295 bytes, over this channel's limit"):
        channel.recv(drafter_pb2.DrafterRequest, timeout=1)
    raw.close()

    raw, channel = _raw_pair(listener)
    raw.sendall(HEADER.pack(2) + b"\x0a\xff")  # field 1, length-delimited, length cut short
    with pytest.raises(FrameError, match="frame of 2 bytes is not a valid dflash.v1.DrafterRequest"):
        channel.recv(drafter_pb2.DrafterRequest, timeout=1)
    raw.close()

    raw, channel = _raw_pair(listener)
    raw.sendall(HEADER.pack(10) + b"abc")
    raw.close()
    with pytest.raises(ChannelClosed, match="closed the channel after 7 bytes of a frame"):
        channel.recv(drafter_pb2.DrafterRequest, timeout=1)


def test_close_wakes_blocked_threads_and_connect_fails_clearly(listener):
    raw, channel = _raw_pair(listener)
    errors = []

    def wait_for(call):
        try:
            call()
        except ChannelClosed as err:
            errors.append(err)

    threads = [threading.Thread(target=wait_for, args=(lambda: channel.recv(drafter_pb2.DrafterRequest),)),
               threading.Thread(target=wait_for, args=(listener.accept,))]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    channel.close()
    listener.close()
    for thread in threads:
        thread.join(timeout=2)
    raw.close()
    assert not any(thread.is_alive() for thread in threads)
    messages = sorted(str(err) for err in errors)
    assert len(messages) == 2
    assert "this side closed the channel" in messages[0] and "is closed" in messages[1]

    with pytest.raises(ConnectionError, match=f"cannot open a frame channel to 127.0.0.1:{listener.address[1]}"):
        connect(listener.address, timeout=1)
    other = FrameListener()
    with pytest.raises(TimeoutError, match="no peer connected to .* within 0.1 s"):
        other.accept(timeout=0.1)
    other.close()


# -- CUDA IPC (run on a GPU machine) --------------------------------------------------------------

@needs_cuda
def test_cuda_buffer_opened_in_a_spawned_child(peer):
    neighbour = torch.zeros(3, device="cuda")  # small blocks share a segment: a non-zero offset
    weights = torch.randn(10, 16, device="cuda")
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    owner = SharedTensor.allocate("features", (4, 8), torch.bfloat16, "cuda")
    owner.tensor.copy_(torch.arange(32, dtype=torch.bfloat16).view(4, 8))
    head = SharedTensor.wrap("lm_head", weights[3:7])  # in place, at an offset into its storage
    try:
        desc = owner.describe()
        assert desc.WhichOneof("location") == "cuda_ipc_handle" and desc.device == owner.tensor.device.index
        assert peer("open", desc.SerializeToString()) == [4, 8]
        assert peer("open", head.describe().SerializeToString()) == [4, 16]
        assert peer("read", "features") == owner.tensor.float().tolist()
        assert peer("read", "lm_head") == weights[3:7].tolist()

        owner.tensor[1].fill_(-2.0)
        weights[4].fill_(9.0)
        torch.cuda.synchronize()  # the child's reads are ordered after nothing of ours
        assert peer("read", "features")[1] == [-2.0] * 8
        assert peer("read", "lm_head")[1] == [9.0] * 16
        peer("write", "features", 3, 5.0)
        assert owner.tensor[3].float().tolist() == [5.0] * 8
        peer("close", "features")
        peer("close", "lm_head")
    finally:
        owner.close()
        head.close()
    del owner
    torch.cuda.synchronize()
    # The exported block went back to the allocator, not into torch's IPC limbo.
    assert torch.cuda.memory_allocated() == allocated_before


@needs_cuda
def test_cuda_feature_ring_read_in_a_spawned_child(peer):
    shared = SharedTensor.allocate("ring", (16, 64), torch.bfloat16, "cuda")
    ring = FeatureRing(shared)
    writes_done = WritesDone(shared.tensor.device)
    try:
        peer("open", shared.describe().SerializeToString())
        for n, first in ((5, 0.0), (9, 10.0), (6, 20.0), (16, 30.0)):  # the third block wraps
            torch.cuda._sleep(50_000_000)  # the copy in is still queued when the handle leaves
            block = (torch.arange(n * 64, device="cuda").view(n, 64) % 251 + first).to(torch.bfloat16)
            handle = ring.write(block)  # no synchronize here: the peer waits for the event
            writes_done.record()
            assert peer("rows", "ring", handle.SerializeToString(), writes_done.handle) == block.float().tolist()
        peer("close", "ring")
    finally:
        shared.close()


@needs_cuda
def test_waiting_for_the_writes_of_a_peer_that_died_ends_when_it_dies(doomed_peer):
    opened = OpenedWritesDone(doomed_peer("record_late", 60.0), torch.device("cuda"))
    with pytest.raises(TimeoutError):
        opened.wait(timeout=0.2)  # its event completes a minute from now
    doomed_peer.process.kill()
    doomed_peer.process.join()
    start = time.monotonic()
    try:  # done, or refused: never a wait until the timeout
        opened.wait(timeout=30, owner_alive=doomed_peer.process.is_alive)
    except (ConnectionError, RuntimeError):
        pass
    assert time.monotonic() - start < 2
