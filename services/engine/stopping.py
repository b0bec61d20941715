"""Where a request's output ends, and its text as it streams.

A speculative round emits up to B tokens at once, so stop conditions are checked token by token
inside the round: generation ends exactly at the first EOS / stop token, at max_tokens, or where a
stop string completes — never a few tokens later (peers.md §4: stops inside an accepted block).

Stop tokens (EOS and stop_token_ids) are returned in the token ids and counted as output tokens,
but their text is not streamed (vLLM's convention).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:  # annotations only: the router's and the replica's processes need no torch for these
    from dflash_serve.services.engine.sampling_params import SamplingParams



class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens (or the model's context) reached
    CANCELLED = "cancelled"
    ERROR = "error"


# Prompt tokens decoded ahead of the output, so that the first output token gets the spacing it
# has in context (SentencePiece-style tokenizers drop a leading space at the start of a decode).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# tokenizers raises a plain Exception with this message when a decode does not start with the text
# already emitted (a decoder whose output for earlier tokens depends on later ones).
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns output token ids into text as they come, emitting only text that is final.

    The text of new tokens is the decode of (context + new tokens) minus the decode of the
    context, where the context is the tokens of the last emitted text (at first, the prompt's
    last few). Text ending in U+FFFD is held back: with byte-level tokenizers a multi-byte
    character spans several tokens and is broken until the last one arrives.

    A Rust tokenizer (a `tokenizers.Tokenizer`, or a transformers tokenizer's backend_tokenizer)
    does this in tokenizers' DecodeStream, one call per step; any other tokenizer (anything with
    decode(ids, skip_special_tokens=...)) decodes the same two windows from Python.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._rust = _rust_tokenizer(tokenizer)
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])  # the tokens of the last emitted text
        self._pending: list[int] = []  # tokens since, whose text is not final yet
        self._stream = self._stream_from_context()

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly final text ('' while a character is still incomplete)."""
        token_ids = list(token_ids)
        if not token_ids:
            return ""
        self._pending += token_ids
        text = None
        if self._stream is not None:
            try:
                text = self._stream.step(self._rust, token_ids) or ""
            except Exception as err:  # noqa: BLE001 - tokenizers raises this one untyped
                if not str(err).startswith(_INVALID_PREFIX):
                    raise
                self._stream = None  # its state is spoiled: this step by slicing, a new one after
        if text is None:
            text = self._window_text(hold_incomplete=True)
        if text:
            self._emitted()
        return text

    def flush(self) -> str:
        """All text not yet returned, an incomplete trailing character included (as U+FFFD)."""
        text = self._window_text(hold_incomplete=False)
        if text:
            self._stream = None  # it still holds the tokens just flushed
            self._emitted()
        return text

    def _emitted(self) -> None:
        """The pending tokens' text went out: they are the next step's context."""
        self._context, self._pending = self._pending, []
        if self._stream is None:
            self._stream = self._stream_from_context()

    def _stream_from_context(self) -> DecodeStream | None:
        """A DecodeStream that emits text after self._context, or None (then the window path runs
        until the next emission): without a Rust tokenizer, or when the context ends inside a
        character (a prompt given as token ids), where DecodeStream would emit the context too."""
        if self._rust is None or self._decode(self._context).endswith(_REPLACEMENT_CHAR):
            return None
        return DecodeStream(self._context, skip_special_tokens=self.skip_special_tokens)

    def _window_text(self, *, hold_incomplete: bool) -> str:
        context_text = self._decode(self._context)
        full_text = self._decode(self._context + self._pending)
        if len(full_text) <= len(context_text) or (hold_incomplete and full_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        return full_text[len(context_text) :]

    def _decode(self, ids: list[int]) -> str:
        decoder = self._rust or self.tokenizer  # the stream's own decode, so that both agree
        return decoder.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _rust_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The tokenizers.Tokenizer behind `tokenizer`, or None. transformers' Python-side
    clean_up_tokenization_spaces (WordPiece / Unigram tokenizers that ask for it) is not applied:
    on windows of a stream it can delete a character outright (" ," after an emitted " " cleans
    to ","), so streamed text is the Rust decode, as vLLM streams it."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)


class StopChecker:
    """Per request: cuts each round's tokens at the first stop and produces the text to stream.

    A stop string ends the text right before it (it and everything after are dropped); the token
    that completed it is the last token returned. Text that might be the start of a stop string
    (the last len(longest stop string) - 1 characters) is held back until it cannot be.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int],
        prompt_len: int,
        detokenizer: IncrementalDetokenizer | None,
        max_output_tokens: int | None = None,
    ):
        """max_output_tokens: the output budget when the context is shorter than params.max_tokens
        allows (default: params.max_tokens). Without a detokenizer no text is produced, so stop
        strings cannot be honoured and are refused."""
        if params.stop and detokenizer is None:
            raise ValueError("stop strings need a detokenizer (the engine was built without a tokenizer)")
        self.prompt_len = prompt_len
        self.max_output_tokens = params.max_tokens if max_output_tokens is None else max_output_tokens
        if self.max_output_tokens <= 0:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids) | eos
        self.stop_strings = params.stop
        self.detokenizer = detokenizer
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._held_back_chars = max((len(s) for s in params.stop), default=1) - 1
        self._pending_text = ""  # final text not yet streamed, held back for stop-string matching

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.prompt_len + self.num_output_tokens

    def append(self, tokens: Sequence[int]) -> tuple[list[int], str, FinishReason | None]:
        """One round's emitted tokens (in order) -> (tokens kept, text to stream, finish reason).

        Tokens after the first stop are dropped. A stop token is kept in the ids (it counts toward
        max_tokens and usage) but its text is not streamed. Calling again after a finish is an error.
        """
        if self.finish_reason is not None:
            raise RuntimeError(f"append after the request finished ({self.finish_reason})")
        if not tokens:
            raise ValueError("append needs at least one token")
        kept, reason = self._cut_at_stop_token_or_length(tokens)
        text_ids = kept[:-1] if reason is FinishReason.STOP else kept
        text, stopped_at = self._text(text_ids)
        if stopped_at is not None:
            kept, reason = kept[: stopped_at + 1], FinishReason.STOP
        elif reason is not None and self.detokenizer is not None:
            flushed, stopped = self._match(self.detokenizer.flush(), final=True)
            text += flushed
            reason = FinishReason.STOP if stopped else reason
        self.num_output_tokens += len(kept)
        self.finish_reason = reason
        return kept, text, reason

    def _cut_at_stop_token_or_length(self, tokens: Sequence[int]) -> tuple[list[int], FinishReason | None]:
        budget = self.max_output_tokens - self.num_output_tokens
        for i, token in enumerate(tokens[:budget]):
            if token in self.stop_token_ids:
                return list(tokens[: i + 1]), FinishReason.STOP
        if len(tokens) >= budget:
            return list(tokens[:budget]), FinishReason.LENGTH
        return list(tokens), None

    def _text(self, token_ids: list[int]) -> tuple[str, int | None]:
        """(text to stream, index of the token that completed a stop string or None)."""
        if self.detokenizer is None:
            return "", None
        if not self.stop_strings:
            # One decode per round; a round ending mid-character streams with the next one.
            return self._match(self.detokenizer.add(token_ids))[0], None
        # Token by token, so that a stop string is attributed to the token that completed it.
        text = ""
        for i, token in enumerate(token_ids):
            piece, stopped = self._match(self.detokenizer.add([token]))
            text += piece
            if stopped:
                return text, i
        return text, None

    def _match(self, new_text: str, *, final: bool = False) -> tuple[str, bool]:
        """Add final text; return (text safe to stream now, whether a stop string was found).
        final: the output ends here, so nothing needs holding back."""
        pending = self._pending_text + new_text
        found = [i for i in (pending.find(s) for s in self.stop_strings) if i >= 0]
        if found:
            self._pending_text = ""
            return pending[: min(found)], True
        keep = 0 if final else min(self._held_back_chars, len(pending))
        self._pending_text = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False
