"""The streams between routers and a verifier's engine process (protos/dflash/v1/outputs.proto).

A request's outputs do not travel back through a Ray call. Ray Serve sends every item that a
streaming call yields as an object of its own, and at 32 requests with a step every few
milliseconds that was most of the serving path's time. Instead the engine process keeps one
channel to each router (`RouterChannel`) and writes one frame per step into it, for all of that
router's requests, without blocking. A channel opens one of two ways:

- through Ray Serve: each router replica listens on a socket (`OutputListener`, asyncio) and names
  it, with a secret, in every request's call (`StreamAddress`); the engine connects there. The call
  stays open until the request ends and returns the name of the channel its outputs went to, so
  Serve counts the request for routing, queue lengths and autoscaling, cancelling the call cancels
  the request, and a lost replica surfaces on the call;
- the direct intake: the engine process listens too (`IntakeConnection` is its end of one router's
  connection), and a router that knows the address (`EngineChannel`) sends its requests and
  cancellations over the same connection that brings their outputs back. A Serve call costs a
  first token 3-5 ms (BENCHMARKS, the serving path); this costs a frame each way.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import select
import socket
import time
import uuid
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from dflash_serve.services.api.dflash.v1 import generation_pb2, outputs_pb2
from dflash_serve.services.engine.request import RequestOutput, SpecStats
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.transport.channel import DEFAULT_MAX_FRAME_BYTES, HEADER, PEER_HUNG_UP, SEND_FLAGS

log = logging.getLogger(__name__)

# The error of the outputs that end a replica's requests when its engine loop stops (a sticky CUDA
# error, a lost tensor-parallel rank): the replica, not the request, failed.
LOOP_STOPPED = "the engine loop stopped: "
CONNECT_TIMEOUT_S = 10.0
# Unsent bytes a router may fall behind by before its channel is closed and its requests fail:
# seconds of output at any load, and a bound on what a stopped router can make a verifier hold.
MAX_UNSENT_BYTES = 64 * 2**20
# Channels a router remembers as closed, for calls that end after their channel did (a verifier
# restarts far less often than this many times within one request's life).
CLOSED_STREAMS_KEPT = 1024

FINISH_REASONS = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: generation_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR,
}
_REASON_OF = {code: reason for reason, code in FINISH_REASONS.items()}


@dataclass(frozen=True)
class StreamAddress:
    """Where a stream connects: a listener's host and port, and the secret it expects."""

    host: str
    port: int
    token: bytes


class StreamLost(ConnectionError):
    """The channel that carried a request's outputs closed before the request's end arrived."""


def _frame(message) -> bytes:
    payload = message.SerializeToString()
    return HEADER.pack(len(payload)) + payload


def sampling_to_proto(params: SamplingParams) -> outputs_pb2.ResolvedSampling:
    return outputs_pb2.ResolvedSampling(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
        max_tokens=params.max_tokens, stop=params.stop, stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, num_speculative_tokens=params.num_speculative_tokens)


def sampling_from_proto(sampling: outputs_pb2.ResolvedSampling) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None, max_tokens=sampling.max_tokens,
        stop=tuple(sampling.stop), stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
        num_speculative_tokens=(sampling.num_speculative_tokens if sampling.HasField("num_speculative_tokens")
                                else None))


# -- the engine's end -----------------------------------------------------------------------------


class RouterChannel:
    """The engine's channel to one router. Only the engine's thread adds to it and flushes it,
    once a step; a send never blocks that thread (what the socket does not take now waits for
    the next flush)."""

    def __init__(self, sock: socket.socket, peer: str, *, direct: bool):
        """sock: connected; direct: the router's direct intake (else a Serve call's `reply_to`, whose
        requests' calls wait for their ends)."""
        self.peer = peer
        self.direct = direct
        self.stream_id = uuid.uuid4().hex
        self.requests: set[str] = set()  # its requests not yet finished (engine thread only)
        self.closed_because = ""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._hung_up = select.poll()
        self._hung_up.register(sock, PEER_HUNG_UP)
        self._step = outputs_pb2.StepOutputs()
        self._unsent = bytearray()

    @classmethod
    def connect(cls, reply_to: StreamAddress) -> RouterChannel:
        """The channel a Serve call's `reply_to` names (blocks for up to CONNECT_TIMEOUT_S)."""
        try:
            sock = socket.create_connection((reply_to.host, reply_to.port), timeout=CONNECT_TIMEOUT_S)
        except OSError as err:
            raise ConnectionError(f"cannot open the output stream to the router at {reply_to.host}:"
                                  f"{reply_to.port}: {err}") from err
        channel = cls(sock, f"{reply_to.host}:{reply_to.port}", direct=False)
        channel._unsent += _frame(outputs_pb2.OutputsHello(
            version=outputs_pb2.OUTPUTS_VERSION_1, token=reply_to.token, stream_id=channel.stream_id))
        return channel

    @property
    def closed(self) -> bool:
        return self._sock is None

    def add(self, out: RequestOutput) -> None:
        delta = self._step.outputs.add(request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
                                       num_prompt_tokens=out.num_prompt_tokens,
                                       num_output_tokens=out.num_output_tokens)
        if out.finished:
            delta.finish_reason = FINISH_REASONS.get(out.finish_reason, generation_pb2.FINISH_REASON_ERROR)
            stats = out.stats
            delta.spec_stats.CopyFrom(generation_pb2.SpecStats(
                num_drafts=stats.rounds, num_draft_tokens=stats.draft_tokens,
                num_accepted_tokens=stats.accepted_tokens, mean_acceptance_length=stats.mean_acceptance_length,
                accepted_per_position=stats.accepted_per_position))
            if out.error:
                delta.error = out.error

    def refuse(self, request_id: str, reason: str) -> None:
        """The engine refused a request of the direct intake (`Engine.add_request`'s ValueError)."""
        self._step.outputs.add(request_id=request_id, finish_reason=generation_pb2.FINISH_REASON_ERROR,
                               error=reason, refused=True)

    def flush(self) -> bool:
        """Sends this step's deltas and whatever earlier flushes left; False once the router is gone."""
        if self._sock is None:
            return False
        if self._step.outputs:
            self._unsent += _frame(self._step)
            self._step.Clear()
        if self._hung_up.poll(0):
            return self._close("the router closed the stream")
        if not self._unsent:
            return True
        try:
            sent = self._sock.send(self._unsent, SEND_FLAGS)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            return self._close(f"sending to the router failed: {err}")
        del self._unsent[:sent]
        if len(self._unsent) > MAX_UNSENT_BYTES:
            return self._close(f"the router fell {len(self._unsent)} bytes behind")
        return True

    def close(self, reason: str = "the verifier closed the stream") -> None:
        self._close(reason)

    def _close(self, reason: str) -> bool:
        sock, self._sock = self._sock, None
        if sock is not None:
            self.closed_because = reason
            sock.close()
        return False


class IntakeConnection:
    """The engine's end of one router's direct intake: the router's requests and cancellations
    come in on it (read without blocking, once a step), and `channel` sends their outputs back on
    the same socket. The first frame must be an IntakeHello with this engine's secret."""

    def __init__(self, sock: socket.socket, peer: str, token: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.channel = RouterChannel(sock, peer, direct=True)
        self.max_frame_bytes = max_frame_bytes
        self.accepted = time.monotonic()
        self.greeted = False  # its hello came, with the secret
        self._sock = sock
        self._token = token
        self._received = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[outputs_pb2.IntakeMessages]:
        """What arrived since the last read; raises ConnectionError once the router hung up or sent
        something that is not this protocol (the stream cannot be trusted past it)."""
        while True:
            try:
                chunk = self._sock.recv(2**20)
            except BlockingIOError:
                break
            except OSError as err:
                raise ConnectionError(f"reading from the router failed: {err}") from err
            if not chunk:
                raise ConnectionError("the router closed its intake")
            self._received += chunk
        messages = []
        while len(self._received) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._received)
            if length > self.max_frame_bytes:
                raise ConnectionError(f"a frame of {length} bytes, over the limit of {self.max_frame_bytes}")
            if len(self._received) < HEADER.size + length:
                break
            payload = bytes(self._received[HEADER.size:HEADER.size + length])
            del self._received[:HEADER.size + length]
            try:
                if not self.greeted:
                    hello = outputs_pb2.IntakeHello.FromString(payload)
                    if hello.version != outputs_pb2.INTAKE_VERSION_1 or not secrets.compare_digest(hello.token,
                                                                                                    self._token):
                        raise ConnectionError(f"wrong version ({hello.version}) or token")
                    self.greeted = True
                else:
                    messages.append(outputs_pb2.IntakeMessages.FromString(payload))
            except DecodeError as err:
                raise ConnectionError(f"a bad frame: {err}") from err
        return messages


# -- the router's end -----------------------------------------------------------------------------


def _request_output(delta: outputs_pb2.RequestDelta) -> RequestOutput:
    finished = delta.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
    stats = SpecStats()
    if finished:
        s = delta.spec_stats
        stats = SpecStats(rounds=s.num_drafts, draft_tokens=s.num_draft_tokens, accepted_tokens=s.num_accepted_tokens,
                          accepted_per_position=list(s.accepted_per_position))
    return RequestOutput(delta.request_id, list(delta.token_ids), delta.text, finished,
                         _REASON_OF.get(delta.finish_reason) if finished else None, delta.num_prompt_tokens,
                         delta.num_output_tokens, stats, error=delta.error or None)


class OutputListener:
    """A router's end of the output streams: accepts the verifiers' channels, checks each one's
    hello, and puts every delta into the queue of the request it belongs to (a `RequestOutput`)
    or, when a channel closes first, a `StreamLost`. All on the router's event loop."""

    def __init__(self, host: str = "127.0.0.1", *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.host = host
        self.max_frame_bytes = max_frame_bytes
        self._token = secrets.token_bytes(16)
        self._reply_to: StreamAddress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Lock | None = None
        self._server: asyncio.Server | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._streams: dict[str, set[str]] = {}  # open channels by stream id: their requests still open here
        self._closed: dict[str, None] = {}  # the last CLOSED_STREAMS_KEPT channels that closed, oldest first
        self._early: dict[str, set[str]] = {}  # requests attached to a channel whose hello is not read yet
        self._handlers: set[asyncio.Task] = set()  # one a channel
        self._wakers: dict[str, asyncio.Future] = {}  # per open request: done once its end is queued

    async def reply_to(self) -> StreamAddress:
        """This router's address for the verifiers; listens from the first call on, on the
        running event loop (a server has one for life; a test may run several in turn)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._reply_to, self._starting = loop, None, asyncio.Lock()
            if self._server is not None:
                self._server.close()  # its loop is gone: nothing reads what it would accept
        async with self._starting:
            if self._reply_to is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
                port = self._server.sockets[0].getsockname()[1]
                self._reply_to = StreamAddress(self.host, port, self._token)
        return self._reply_to

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue the request's outputs will arrive in."""
        self._queues[request_id] = queue = asyncio.Queue()
        return queue

    async def wait_unless_ended(self, request_id: str, seconds: float) -> None:
        """Sleep `seconds`, or less if what ends the request (its last output, its failure) arrives
        meanwhile or is here already: a paced request's last message is not held back."""
        ended = self._ended(request_id)
        if not ended.done():
            await asyncio.wait((ended,), timeout=seconds)

    def put_end(self, request_id: str, item) -> None:
        """Put what ends the request (its last output, a StreamLost, its call's end) and wake it."""
        queue = self._queues.get(request_id)
        if queue is None:
            return
        queue.put_nowait(item)
        ended = self._ended(request_id)
        if not ended.done():
            ended.set_result(None)

    def _ended(self, request_id: str) -> asyncio.Future:
        """Done once something that ends the request is in its queue."""
        ended = self._wakers.get(request_id)
        if ended is None:
            ended = self._wakers[request_id] = asyncio.get_running_loop().create_future()
        return ended

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._wakers.pop(request_id, None)
        for requests in (*self._streams.values(), *self._early.values()):
            requests.discard(request_id)
        for stream_id in [s for s, requests in self._early.items() if not requests]:
            del self._early[stream_id]

    def attach(self, request_id: str, stream_id: str) -> None:
        """The request's call ended and named the channel its outputs went to: whatever has not
        arrived is still in that channel, so its loss is the request's. If it closed already,
        the loss is put in the queue now (after anything it delivered)."""
        if stream_id in self._streams:
            self._streams[stream_id].add(request_id)
        elif stream_id in self._closed:
            self.put_end(request_id, StreamLost("the verifier's output stream closed"))
        else:  # its hello is still on the way
            self._early.setdefault(stream_id, set()).add(request_id)

    async def aclose(self) -> None:
        """Stop listening and close every channel (their requests get a StreamLost)."""
        if self._server is not None:
            self._server.close()
            for handler in list(self._handlers):
                handler.cancel()
            await self._server.wait_closed()

    async def connect(self, address: StreamAddress) -> EngineChannel:
        """A direct intake to the engine process at `address`; raises OSError if it cannot be reached."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port),
                                                CONNECT_TIMEOUT_S)
        writer.write(_frame(outputs_pb2.IntakeHello(version=outputs_pb2.INTAKE_VERSION_1, token=address.token)))
        stream_id = uuid.uuid4().hex
        requests = self._streams[stream_id] = set()
        relay = asyncio.create_task(self._relay(reader, writer, stream_id))
        return EngineChannel(address, writer, requests, relay)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A verifier's channel for the requests of this router's Serve calls."""
        task = asyncio.current_task()
        self._handlers.add(task)  # aclose cancels it while it waits for the hello too
        try:
            try:
                hello = outputs_pb2.OutputsHello.FromString(await self._read_frame(reader))
            except (Exception, asyncio.CancelledError):  # no hello (a port scan, a broken connection, closing)
                writer.close()
                return
            if hello.version != outputs_pb2.OUTPUTS_VERSION_1 or not secrets.compare_digest(hello.token, self._token):
                log.warning("refused an output stream from %s: wrong version (%d) or token",
                            writer.get_extra_info("peername"), hello.version)
                writer.close()
                return
            self._streams[hello.stream_id] = self._early.pop(hello.stream_id, set())
            await self._relay(reader, writer, hello.stream_id)
        finally:
            self._handlers.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream_id: str) -> None:
        """Puts every delta of the stream into its request's queue; once the stream closes, its
        requests still open get a StreamLost."""
        peer = writer.get_extra_info("peername")
        reason = "the verifier closed the stream"
        requests = self._streams[stream_id]
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            while True:
                step = outputs_pb2.StepOutputs.FromString(await self._read_frame(reader))
                for delta in step.outputs:
                    if delta.request_id not in self._queues:  # finished or cancelled here already
                        continue
                    if delta.refused:
                        requests.discard(delta.request_id)
                        self.put_end(delta.request_id, Refused(delta.error))
                        continue
                    out = _request_output(delta)
                    if out.finished:
                        requests.discard(delta.request_id)
                        self.put_end(delta.request_id, out)
                    else:
                        requests.add(delta.request_id)
                        self._queues[delta.request_id].put_nowait(out)
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            if not isinstance(err, asyncio.IncompleteReadError):
                reason = f"the output stream from {peer} broke: {err}"
        except Exception as err:  # noqa: BLE001 - a malformed frame: the stream cannot be trusted past it
            reason = f"the output stream from {peer} sent a bad frame: {err}"
            log.warning(reason)
        except asyncio.CancelledError:
            reason = "the router closed the stream"
        finally:
            self._handlers.discard(task)
            try:
                writer.close()
            except RuntimeError:  # its event loop ended with the channel open (a test's asyncio.run)
                return
            self._closed[stream_id] = None
            if len(self._closed) > CLOSED_STREAMS_KEPT:
                del self._closed[next(iter(self._closed))]
            for request_id in self._streams.pop(stream_id, ()):
                self.put_end(request_id, StreamLost(f"the verifier's output stream closed: {reason}"))

    async def _read_frame(self, reader: asyncio.StreamReader) -> bytes:
        (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if length > self.max_frame_bytes:
            raise ConnectionError(f"a frame of {length} bytes, over the limit of {self.max_frame_bytes}")
        return await reader.readexactly(length)


class Refused:
    """The engine refused a request of the direct intake: `error` is the ValueError it raised (as a
    Serve call's end carries it)."""

    __slots__ = ("error", "stream_id")

    def __init__(self, reason: str):
        self.error, self.stream_id = ValueError(reason), None


class EngineChannel:
    """A router's direct intake to one engine process: its requests and their cancellations go out
    on it, and their outputs come back on it into the listener's queues."""

    def __init__(self, address: StreamAddress, writer: asyncio.StreamWriter, requests: set[str], relay: asyncio.Task):
        self.address = address
        self.requests = requests  # sent and not yet ended (the listener drops the ended ones)
        self._writer = writer
        self._relay = relay

    @property
    def closed(self) -> bool:
        return self._relay.done()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Sends the request; its outputs, or a StreamLost, arrive in its queue (`OutputListener.open` first)."""
        self.requests.add(request_id)
        self._writer.write(_frame(outputs_pb2.IntakeMessages(adds=[outputs_pb2.AddRequest(
            request_id=request_id, prompt_ids=prompt_ids, sampling=sampling_to_proto(params))])))

    def cancel(self, request_id: str) -> None:
        if not self.closed:
            self._writer.write(_frame(outputs_pb2.IntakeMessages(cancels=[request_id])))

    def close(self) -> None:
        self._relay.cancel()
