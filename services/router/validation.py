"""Checks on a GenerateRequest before it reaches a verifier.

Every check raises InvalidRequest whose message says what is wrong and what to send instead; the
router answers it with INVALID_ARGUMENT. Sampling fields are checked by the engine's own
`SamplingParams.validate`, so the router and the engine accept exactly the same values.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from dflash_serve.services.engine.sampling_params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidRequest(ValueError):
    """A client error; the message says what to fix."""


def sampling_params(sampling, *, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
    """The request's `dflash.v1.SamplingParams` with the server's defaults for unset fields
    (greedy, top_p 1, top_k 0, default_max_tokens), validated."""
    params = SamplingParams(
        temperature=_float32_as_typed(sampling.temperature) if sampling.HasField("temperature") else 0.0,
        top_p=_float32_as_typed(sampling.top_p) if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k if sampling.HasField("top_k") else 0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        max_tokens=(sampling.max_tokens if sampling.HasField("max_tokens")
                    else min(default_max_tokens, max_tokens_limit)),
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        num_speculative_tokens=(sampling.num_speculative_tokens if sampling.HasField("num_speculative_tokens")
                                else None),
    )
    try:
        params.validate(max_tokens_limit=max_tokens_limit)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    return params


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Refuses a prompt that leaves no room to generate; caps max_tokens at the room left (the
    request then ends with FINISH_REASON_LENGTH at the model's context, as the engine does)."""
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens but the model's context is {max_model_len} tokens: "
            f"shorten the prompt to at most {max_model_len - 1} tokens"
        )
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, max_model_len - prompt_len))


def check_prompt_text(prompt: str) -> None:
    if not prompt:
        raise InvalidRequest("prompt is empty: send some text (or chat messages, or token_ids)")


def chat_messages(messages: Sequence) -> list[dict[str, str]]:
    """`dflash.v1.ChatMessage`s -> the dicts a chat template renders."""
    if not messages:
        raise InvalidRequest("chat has no messages: send at least one, e.g. {role: 'user', content: 'Hello'}")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"chat message {i} has role {message.role!r}; allowed roles: {', '.join(CHAT_ROLES)}"
            )
    return [{"role": m.role, "content": m.content} for m in messages]


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids:
        raise InvalidRequest("token_ids is empty: send at least one token id")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside this model's vocabulary [0, {vocab_size})")


def check_stop_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids {bad[:5]} are outside this model's vocabulary [0, {vocab_size}): "
                             "a stop token must be one the model can generate")


def max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """The most UTF-8 bytes of text that can tokenize into fewer than `max_model_len` tokens: no
    token stands for more bytes than its vocabulary string's UTF-8 encoding (byte-level and
    SentencePiece strings spell a byte in one or more bytes, never in less)."""
    longest = max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    return max_model_len * longest


def check_prompt_bytes(nbytes: int, limit: int, max_model_len: int) -> None:
    """Refuses text too long for the context before tokenizing it: tokenizing megabytes takes
    seconds, and one request must not stall the ingress that long."""
    if nbytes > limit:
        raise InvalidRequest(
            f"the prompt is {nbytes} bytes of text; this model's context of {max_model_len} tokens holds at "
            f"most {limit} bytes of it: shorten the prompt")


def no_input() -> InvalidRequest:
    return InvalidRequest("the request has no input: set one of prompt, chat or token_ids")


def _float32_as_typed(value: float) -> float:
    """The shortest decimal with the same float32 value. Proto floats are float32, so a client's
    0.9 arrives as 0.8999999762; seeded sampling with 0.9 must match what the same seed and 0.9
    give through the embedded engine. NaN and infinities come back unchanged (and are refused)."""
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == value:
            return candidate
    return value
