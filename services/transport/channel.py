"""Protobuf frames over a stream socket: the per-step path between a verifier and its drafter.

A frame is a 4-byte big-endian length and then the serialized message. The drafter listens, the
verifier connects, and the channel stays open for the session. A peer that goes away surfaces as
`ChannelClosed` on the next send or recv, never as a hang; recv takes a timeout for a peer that
is alive but stuck.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import NoReturn

from google.protobuf.message import DecodeError, Message

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 64 * 2**20
_RECV_BYTES = 2**20  # most one recv asks for: frames are small, Hello the largest by far
# How long a recv that asks for it polls without sleeping before it blocks. Waking a thread
# blocked on a socket costs ~0.1 ms per hop on a VM, twice per round between a verifier and its
# drafter (a batch-1 round is ~10 ms); both wait less than this between frames while serving, and
# block (no CPU burnt) once idle.
BUSY_POLL_SECONDS = 0.02

# Linux reports a peer's FIN as POLLRDHUP even while its earlier frames are still unread here.
PEER_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
# A send to a dead peer must raise, not deliver SIGPIPE (Python ignores it, a host may not).
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


class ChannelClosed(ConnectionError):
    """The peer went away or this side closed the channel: no more frames in either direction."""


class FrameError(ChannelClosed):
    """The peer sent bytes that are not a frame. The stream cannot be trusted past them, so the
    channel is closed."""


class FrameTooLarge(ValueError):
    """A message is larger than the channel's frame limit; nothing was sent."""


class FrameChannel:
    """One end of an open channel. One thread may send while another receives."""

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        sock.setblocking(True)  # waits with a timeout go through poll, so send never times out
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame leaves at once
        self.max_frame_bytes = max_frame_bytes
        self.peer = sock.getpeername()
        self._sock = sock
        self._closed_because = ""
        self._received = bytearray()  # bytes of frames not yet returned, kept across a recv timeout
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._hung_up = select.poll()
        self._hung_up.register(sock, PEER_HUNG_UP)

    def send(self, message: Message) -> None:
        payload = message.SerializeToString()
        if len(payload) > self.max_frame_bytes:
            raise FrameTooLarge(f"{type(message).__name__} serializes to {len(payload)} bytes, over this "
                                f"channel's limit of {self.max_frame_bytes}")
        sock = self._open_socket()
        # Without this a send to a dead peer succeeds once (the kernel buffers it) and only the
        # next one fails.
        if self._hung_up.poll(0):
            self._fail(ChannelClosed, "the peer closed the channel")
        try:
            sock.sendall(HEADER.pack(len(payload)) + payload, SEND_FLAGS)
        except OSError as err:
            self._fail(ChannelClosed, f"sending to the peer failed: {err}")

    def recv(self, message_type: type[Message], timeout: float | None = None, *, busy_poll: float = 0.0) -> Message:
        """The next frame, parsed as `message_type`; TimeoutError if none is complete in time (the
        channel stays usable, bytes already read are kept). With `busy_poll`, poll without
        sleeping for up to that many seconds first (latency for a CPU core)."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        if busy_poll > 0 and len(self._received) < HEADER.size:
            spin_until = now + (busy_poll if timeout is None else min(busy_poll, timeout))
            while not self._readable.poll(0) and time.monotonic() < spin_until:
                pass
        self._fill(HEADER.size, deadline)
        (length,) = HEADER.unpack_from(self._received)
        if length > self.max_frame_bytes:
            self._fail(FrameError, f"the peer announced a frame of {length} bytes, over this channel's limit "
                                   f"of {self.max_frame_bytes} (a corrupt or foreign stream?)")
        end = HEADER.size + length
        self._fill(end, deadline)
        payload = bytes(self._received[HEADER.size:end])
        del self._received[:end]
        try:
            return message_type.FromString(payload)
        except DecodeError:
            self._fail(FrameError, f"a frame of {length} bytes is not a valid {message_type.DESCRIPTOR.full_name}")

    def peer_hung_up(self) -> bool:
        """Whether the peer has closed its end (or this one is closed); reads nothing."""
        return self._sock is None or bool(self._hung_up.poll(0))

    def close(self) -> None:
        """Close both directions; a thread blocked in recv on this channel wakes with ChannelClosed."""
        self._close("this side closed the channel")

    def _fill(self, size: int, deadline: float | None) -> None:
        """Read until at least `size` bytes are buffered."""
        while len(self._received) < size:
            sock = self._open_socket()
            if deadline is not None and not self._readable.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TimeoutError(f"no complete frame from {self.peer} in time "
                                   f"({len(self._received)} bytes of an unfinished frame buffered)")
            try:
                chunk = sock.recv(min(max(size - len(self._received), 2**16), _RECV_BYTES))
            except OSError as err:
                self._fail(ChannelClosed, f"receiving from the peer failed: {err}")
            if not chunk:
                if self._sock is None:
                    self._fail(ChannelClosed, self._closed_because)
                unfinished = f" after {len(self._received)} bytes of a frame" if self._received else ""
                self._fail(ChannelClosed, f"the peer closed the channel{unfinished}")
            self._received += chunk

    def _open_socket(self) -> socket.socket:
        if self._sock is None:
            raise ChannelClosed(f"channel to {self.peer} is closed: {self._closed_because}")
        return self._sock

    def _fail(self, error_type: type[ChannelClosed], reason: str) -> NoReturn:
        self._close(reason)
        raise error_type(f"channel to {self.peer}: {reason}")

    def _close(self, reason: str) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._closed_because = reason
        self._received.clear()  # what was buffered is not delivered after close
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is gone already
        sock.close()


class FrameListener:
    """The drafter's end: waits for its verifier to connect."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._sock = socket.create_server((host, port))
        self._address = self._sock.getsockname()[:2]
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def accept(self, timeout: float | None = None) -> FrameChannel:
        try:
            self._sock.settimeout(timeout)
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TimeoutError(f"no peer connected to {self.address} within {timeout} s") from None
        except OSError:
            if self._closed:
                raise ChannelClosed(f"the listener at {self.address} is closed") from None
            raise
        return FrameChannel(conn, max_frame_bytes=self.max_frame_bytes)

    def close(self) -> None:
        """Stop listening; a thread blocked in accept wakes with ChannelClosed."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # close() alone does not wake a blocked accept
        except OSError:
            pass  # not every platform allows shutting a listener down
        self._sock.close()


def connect(address: tuple[str, int], timeout: float = 10.0, *,
            max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> FrameChannel:
    """The verifier's end: a channel to the listener at `address`."""
    host, port = address
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"no answer from {host}:{port} within {timeout} s") from None
    except OSError as err:
        raise ConnectionError(f"cannot open a frame channel to {host}:{port}: {err}") from err
    return FrameChannel(sock, max_frame_bytes=max_frame_bytes)
