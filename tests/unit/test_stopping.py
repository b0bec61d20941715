"""Stopping and streaming text: exact stops inside a round (EOS, stop ids, max_tokens, stop
strings), held-back text, and multi-byte characters split across byte-level tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason, IncrementalDetokenizer, StopChecker
from tests.tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tiny_tokenizer()


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def checker(tokenizer, params: SamplingParams, **kwargs) -> StopChecker:
    kwargs.setdefault("eos_token_ids", {tokenizer.token_to_id("<eos>")})
    kwargs.setdefault("detokenizer", IncrementalDetokenizer(tokenizer))
    return StopChecker(params, prompt_len=10, **kwargs)


def run_rounds(stop: StopChecker, tokens: list[int], round_size: int):
    """Feed tokens in rounds until the checker finishes; return (kept ids, streamed pieces, reason)."""
    kept, pieces, reason = [], [], None
    for start in range(0, len(tokens), round_size):
        round_kept, text, reason = stop.append(tokens[start : start + round_size])
        kept += round_kept
        pieces.append(text)
        if reason is not None:
            break
    return kept, pieces, reason


MULTIBYTE = "naïve café: 中文字符 and emoji 🙂🚀 done"


def test_tokenizer_splits_multibyte_characters(tokenizer):
    """Guards the tests below: characters really are split across tokens."""
    pieces = [tokenizer.decode([t]) for t in ids(tokenizer, MULTIBYTE)]
    assert sum("\ufffd" in p for p in pieces) >= 10


@pytest.mark.parametrize("round_size", [1, 2, 3, 16])
def test_multibyte_characters_never_stream_broken(tokenizer, round_size):
    tokens = ids(tokenizer, MULTIBYTE)
    kept, pieces, reason = run_rounds(checker(tokenizer, SamplingParams()), tokens, round_size)
    assert reason is None and kept == tokens
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == MULTIBYTE


def test_detokenizer_holds_a_partial_character_until_it_completes(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    emoji = ids(tokenizer, "🙂")
    assert len(emoji) == 4
    assert [detok.add([t]) for t in emoji] == ["", "", "", "🙂"]


def test_detokenizer_uses_prompt_context_and_works_with_transformers(tokenizer):
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    prompt = ids(tokenizer, "def main():")
    for tok in (tokenizer, wrapped):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
        assert "".join(detok.add([t]) for t in ids(tokenizer, " return 中")) == " return 中"


def test_eos_in_the_middle_of_a_round_stops_there(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    head, tail = ids(tokenizer, "hello world"), ids(tokenizer, " junk after")
    stop = checker(tokenizer, SamplingParams())
    kept, text, reason = stop.append(head + [eos] + tail)
    assert kept == head + [eos]  # the stop token is returned and counted...
    assert text == "hello world"  # ...but its text is not streamed
    assert reason is FinishReason.STOP
    assert stop.num_output_tokens == len(head) + 1
    with pytest.raises(RuntimeError, match="finished"):
        stop.append(tail)


def test_stop_token_ids_stop_and_their_text_is_not_streamed(tokenizer):
    tokens = ids(tokenizer, "x = 1\ny = 2\n")
    stop_id = tokens[3]  # an ordinary token that would decode to text
    assert tokenizer.decode([stop_id])
    stop = checker(tokenizer, SamplingParams(stop_token_ids=(stop_id,)))
    kept, pieces, reason = run_rounds(stop, tokens, round_size=2)
    assert kept == tokens[:4]
    assert "".join(pieces) == tokenizer.decode(tokens[:3])
    assert reason is FinishReason.STOP


def test_max_tokens_stops_exactly_in_the_middle_of_a_round(tokenizer):
    tokens = ids(tokenizer, "alpha beta gamma delta epsilon zeta")
    assert len(tokens) > 8
    stop = checker(tokenizer, SamplingParams(max_tokens=5))
    assert stop.append(tokens[:3])[2] is None
    kept, text, reason = stop.append(tokens[3:8])
    assert kept == tokens[3:5] and reason is FinishReason.LENGTH
    assert stop.num_output_tokens == 5 and stop.num_tokens == 15


def test_context_budget_overrides_max_tokens(tokenizer):
    tokens = ids(tokenizer, "alpha beta gamma delta")
    stop = checker(tokenizer, SamplingParams(max_tokens=100), max_output_tokens=2)
    assert stop.append(tokens) == (tokens[:2], tokenizer.decode(tokens[:2]), FinishReason.LENGTH)


def test_eos_on_the_last_allowed_token_is_a_stop(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    tokens = ids(tokenizer, "ab")[:1] + [eos]
    assert checker(tokenizer, SamplingParams(max_tokens=2)).append(tokens)[2] is FinishReason.STOP


def test_length_cut_inside_a_character_flushes_what_decode_gives(tokenizer):
    tokens = ids(tokenizer, "ok 🙂")
    stop = checker(tokenizer, SamplingParams(max_tokens=len(tokens) - 1))
    kept, text, reason = stop.append(tokens)
    assert reason is FinishReason.LENGTH
    assert text == tokenizer.decode(kept)  # the streamed text equals the text of the returned ids


TEXT = "The answer is 42. END of the story, and more text"


@pytest.mark.parametrize("round_size", [1, 2, 3, 16, 64])
def test_stop_string_within_and_across_rounds(tokenizer, round_size):
    tokens = ids(tokenizer, TEXT)
    stop = checker(tokenizer, SamplingParams(stop=("END",)))
    kept, pieces, reason = run_rounds(stop, tokens, round_size)
    # Streamed text can never be taken back, so the concatenation proves "EN" was not streamed early.
    assert "".join(pieces) == "The answer is 42. "
    assert reason is FinishReason.STOP
    assert "END" in tokenizer.decode(kept) and "END" not in tokenizer.decode(kept[:-1])  # the last kept completes it


def test_stop_string_spanning_two_rounds_is_held_back(tokenizer):
    tokens = ids(tokenizer, "value: ENDING")
    split = next(i for i in range(1, len(tokens)) if tokenizer.decode(tokens[:i]).endswith("EN"))
    stop = checker(tokenizer, SamplingParams(stop=("END",)))
    kept, text, reason = stop.append(tokens[:split])
    assert reason is None and text == "value: "  # "EN" waits: it may be the start of "END"
    kept, rest, reason = stop.append(tokens[split:])
    assert rest == "" and reason is FinishReason.STOP


def test_partial_stop_string_that_does_not_complete_is_released(tokenizer):
    stop = checker(tokenizer, SamplingParams(stop=("END",)))
    kept, pieces, reason = run_rounds(stop, ids(tokenizer, "EN is not E-N-D"), round_size=1)
    assert reason is None and "".join(pieces) == "EN is not E-N"  # the last 2 characters wait
    eos = tokenizer.token_to_id("<eos>")
    assert stop.append([eos]) == ([eos], "-D", FinishReason.STOP)  # a finish flushes them


def test_earliest_of_several_stop_strings_wins_and_multibyte_stops(tokenizer):
    stop = checker(tokenizer, SamplingParams(stop=("story", "42")))
    assert "".join(run_rounds(stop, ids(tokenizer, TEXT), round_size=4)[1]) == "The answer is "
    stop = checker(tokenizer, SamplingParams(stop=("字",)))
    kept, pieces, reason = run_rounds(stop, ids(tokenizer, MULTIBYTE), round_size=3)
    assert "".join(pieces) == "naïve café: 中文" and reason is FinishReason.STOP


def test_ignore_eos_keeps_generating(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    tokens = ids(tokenizer, "one") + [eos] + ids(tokenizer, " two")
    stop = checker(tokenizer, SamplingParams(ignore_eos=True, max_tokens=len(tokens)))
    assert stop.append(tokens) == (tokens, "one two", FinishReason.LENGTH)  # special token text skipped
    # stop_token_ids still apply when EOS is ignored.
    stop = checker(tokenizer, SamplingParams(ignore_eos=True, stop_token_ids=(eos,)))
    assert stop.append(tokens)[2] is FinishReason.STOP


def test_special_tokens_in_text_when_not_skipped(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    stop = checker(tokenizer, SamplingParams(ignore_eos=True), detokenizer=detok)
    assert stop.append(ids(tokenizer, "a") + [eos])[1] == "a<eos>"


def test_without_a_detokenizer_only_ids_are_checked(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    stop = checker(tokenizer, SamplingParams(), detokenizer=None)
    assert stop.append([5, 6, eos, 7]) == ([5, 6, eos], "", FinishReason.STOP)
    with pytest.raises(ValueError, match="stop strings need a detokenizer"):
        checker(tokenizer, SamplingParams(stop=("x",)), detokenizer=None)


class DecodeOnly:
    """A tokenizer with no Rust backend (only decode): the detokenizer's Python window path."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream_text(detok: IncrementalDetokenizer, tokens: list[int], round_size: int) -> tuple[list[str], str]:
    pieces = [detok.add(tokens[i : i + round_size]) for i in range(0, len(tokens), round_size)]
    return pieces, detok.flush()


def assert_decode_stream_matches_window_path(tokenizer, token_ids: list[int], seed: int) -> None:
    """The DecodeStream path streams the same pieces as the Python window path (today's
    algorithm), for random prompt cuts, round sizes and special-token settings."""
    rng = random.Random(seed)
    for _ in range(40):
        cut, round_size, skip = rng.randrange(0, 40), rng.choice([1, 2, 5, 16]), rng.random() < 0.5
        prompt, output = token_ids[:cut], token_ids[cut:]
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(DecodeOnly(tokenizer), prompt, skip_special_tokens=skip)
        assert fast._stream is not None or cut  # the Rust path is the one under test
        assert stream_text(fast, output, round_size) == stream_text(slow, output, round_size)


def test_decode_stream_matches_the_window_path_on_text(tokenizer):
    text = (MULTIBYTE + " Ελληνικά, русский, עברית, हिन्दी, 日本語。<stop>\n") * 4
    assert_decode_stream_matches_window_path(tokenizer, ids(tokenizer, text), seed=0)


def test_decode_stream_matches_the_window_path_on_random_ids(tokenizer):
    """Random ids (what a random-weight model emits): invalid UTF-8, prompts that end inside a
    character, special tokens anywhere."""
    rng = random.Random(1)
    for seed in range(10):
        assert_decode_stream_matches_window_path(tokenizer, [rng.randrange(600) for _ in range(120)], seed)


SMOLLM2 = Path.home() / ".cache" / "dflash-serve" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason=f"no SmolLM2 tokenizer at {SMOLLM2} (dflash fetch-default)")
def test_decode_stream_matches_the_window_path_on_smollm2():
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(SMOLLM2)
    assert smol.backend_tokenizer is not None
    chat = smol.apply_chat_template([{"role": "user", "content": MULTIBYTE}], add_generation_prompt=True, tokenize=False)
    text = chat + MULTIBYTE + " Ελληνικά, русский, 日本語。<|im_end|>\n"
    assert_decode_stream_matches_window_path(smol, smol.encode(text), seed=2)
    rng = random.Random(3)
    assert_decode_stream_matches_window_path(smol, [rng.randrange(len(smol)) for _ in range(120)], seed=3)


def test_prompt_ending_inside_a_character_streams_only_the_output(tokenizer):
    """A prompt given as ids may end inside a character: the output's text does not repeat the
    prompt (DecodeStream alone would emit its prefill text here)."""
    emoji = ids(tokenizer, "ab🙂cd")
    for tok in (tokenizer, DecodeOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok, prompt_ids=emoji[:3])  # "ab" and half the emoji
        assert [detok.add([t]) for t in emoji[3:]] == ["", "", "c", "d"]
    assert IncrementalDetokenizer(tokenizer, prompt_ids=emoji[:3])._stream is None  # until the first text


def test_decoder_that_rewrites_earlier_text_falls_back_to_slicing(tokenizer):
    """tokenizers' DecodeStream raises "Invalid prefix" when a decode does not start with the text
    already emitted; the step is sliced as the window path does, and a new stream goes on."""

    class UppercaseFirstOnEvenCounts:
        def decode_chain(self, tokens: list[str]) -> list[str]:
            tokens = [t.replace("Ġ", " ") for t in tokens]
            if len(tokens) % 2 == 0:
                tokens[0] = tokens[0].upper()
            return tokens

    odd = Tokenizer.from_str(tokenizer.to_str())
    odd.decoder = decoders.Decoder.custom(UppercaseFirstOnEvenCounts())
    words = ids(odd, "hello world again and more")
    with pytest.raises(Exception, match="Invalid prefix"):  # guards the test: the stream does fail here
        stream = DecodeStream()
        for t in words:
            stream.step(odd, t)
    fast, slow = IncrementalDetokenizer(odd), IncrementalDetokenizer(DecodeOnly(odd))
    assert stream_text(fast, words, 1) == stream_text(slow, words, 1)
    assert fast._stream is not None  # back on a stream after the failed step


def test_python_side_space_cleanup_is_not_applied_to_the_stream(tokenizer):
    """transformers' clean_up_tokenization_spaces, applied to the window of each step as the
    window path did, deletes characters (" ," after an emitted " " cleans to ","); the stream is
    the Rust decode, every character kept."""
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=True)
    # transformers cleans up WordPiece output only, unless told to for this byte-level BPE one.
    wrapped.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    tokens = ids(tokenizer, "a , b . c")
    assert wrapped.decode(tokens) == "a, b. c"
    window = IncrementalDetokenizer(DecodeOnly(wrapped))
    assert "".join(window.add([t]) for t in tokens) + window.flush() == "a  b  c"  # the comma and the stop lost
    detok = IncrementalDetokenizer(wrapped)
    assert "".join(detok.add([t]) for t in tokens) + detok.flush() == "a , b . c"
