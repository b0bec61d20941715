"""A blocking gRPC client of `dflash.v1.Generation` (what `dflash client` runs).

Failures arrive as `grpc.RpcError` with the server's status code and a readable message
(INVALID_ARGUMENT for a bad request, RESOURCE_EXHAUSTED when the server is full, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import grpc

from dflash_serve.services.api.dflash.v1 import generation_pb2, generation_pb2_grpc

Metadata = Sequence[tuple[str, str]]


def build_request(
    *,
    prompt: str | None = None,
    chat: Iterable[Mapping[str, str]] | None = None,
    token_ids: Iterable[int] | None = None,
    sampling: Mapping | None = None,
    request_id: str | None = None,
) -> generation_pb2.GenerateRequest:
    """chat: messages as {"role": ..., "content": ...}; sampling: fields of dflash.v1.SamplingParams
    (unset ones take the server's defaults: greedy, its default max_tokens)."""
    inputs = (("prompt", prompt), ("chat", chat), ("token_ids", token_ids))
    given = [name for name, value in inputs if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, chat or token_ids (got {', '.join(given) or 'none'})")
    request = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(**(sampling or {})),
                                             request_id=request_id or "")
    if prompt is not None:
        request.prompt = prompt
    elif chat is not None:
        request.chat.SetInParent()  # an empty list is still a chat (the server says it needs a message)
        request.chat.messages.extend(generation_pb2.ChatMessage(**message) for message in chat)
    else:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(token_ids)
    return request


def stream_completion(
    address: str,
    *,
    prompt: str | None = None,
    chat: Iterable[Mapping[str, str]] | None = None,
    token_ids: Iterable[int] | None = None,
    sampling: dict | None = None,
    request_id: str | None = None,
    timeout: float | None = None,
    metadata: Metadata = (),
) -> Iterator[generation_pb2.GenerateResponse]:
    """Yields the responses as the server streams them; the last one has the finish reason,
    usage and spec_stats. Closing the iterator early cancels the request on the server."""
    request = build_request(prompt=prompt, chat=chat, token_ids=token_ids, sampling=sampling, request_id=request_id)
    return _stream(address, request, timeout, metadata)  # bad arguments fail here, not at the first next()


def complete(
    address: str,
    *,
    prompt: str | None = None,
    chat: Iterable[Mapping[str, str]] | None = None,
    token_ids: Iterable[int] | None = None,
    sampling: dict | None = None,
    request_id: str | None = None,
    timeout: float | None = None,
    metadata: Metadata = (),
) -> generation_pb2.GenerateResponse:
    """The whole completion in one response."""
    request = build_request(prompt=prompt, chat=chat, token_ids=token_ids, sampling=sampling, request_id=request_id)
    with grpc.insecure_channel(address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).Complete(request, timeout=timeout, metadata=metadata)


def _stream(address: str, request, timeout: float | None, metadata: Metadata) -> Iterator:
    with grpc.insecure_channel(address) as channel:
        yield from generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout, metadata=metadata)


def model_info(address: str, *, timeout: float | None = None, metadata: Metadata = ()) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout, metadata=metadata)
