"""Benchmark prompt sets: DFlash's own, read from local files in their published formats (the
folder is named by `--data-dir`; README, "Benchmark prompt sets", lists the files and where they
come from), and `random` token prompts of a fixed length, as vLLM's bench draws them.

Each prompt of a named set is one user message; the server (or the embedded bench) renders it with
the target's chat template and `add_generation_prompt=True`, as DFlash's benchmark does. Only the
first turn of multi-turn sets is used, as in DFlash's server benchmark.

The conversation set (`sharegpt-2turn`) is different: each item is a conversation whose turns are
sent one after the other, each after the answer to the one before has arrived, with the whole
conversation so far (the earlier user turns and the server's own answers) as its messages: what a
chat client sends, and what a prefix cache can serve from memory.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DATA_DIR = "../shared/bench-data"
REASON_STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
)
# MBPP's test split of the sanitized set (the train/validation/prompt splits hold the other task ids).
MBPP_TEST_IDS = range(11, 511)
SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")


# ShareGPT's first human turns include whole papers and logs pasted in; a conversation is kept when
# each of its two turns fits in this many characters (~1,000 tokens), so that the second turn,
# with the first answer, fits the context of small targets.
MAX_TURN_CHARS = 4000


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str  # the user message ("" for token prompts a backend cannot render as text)
    token_ids: tuple[int, ...] | None = None  # sent as is, no chat template (the random set)
    max_tokens: int | None = None  # this prompt's output length, over the run's --max-tokens
    # The conversation before this message, (role, content) pairs: earlier user turns and the
    # server's answers to them (a later turn of a Conversation).
    history: tuple[tuple[str, str], ...] = ()

    @property
    def turn(self) -> int:
        return len(self.history) // 2 + 1

    def messages(self) -> list[dict[str, str]]:
        """The chat messages this request sends: the history, then this user message."""
        return [{"role": role, "content": content} for role, content in self.history] + [
            {"role": "user", "content": self.text}]


@dataclass(frozen=True)
class Conversation:
    """User turns sent one after the other, each once the answer to the previous one has arrived."""

    dataset: str
    id: str
    turns: tuple[str, ...]

    def first(self) -> Prompt:
        return Prompt(self.dataset, self.id, self.turns[0])

    def after(self, sent: Prompt, answer: str) -> Prompt | None:
        """The next turn's request, given the request just answered and its answer (None: the
        conversation is over)."""
        if sent.turn >= len(self.turns):
            return None
        history = (*sent.history, ("user", sent.text), ("assistant", answer))
        return Prompt(self.dataset, self.id, self.turns[sent.turn], history=history)


def _records(path: Path) -> Iterator[dict]:
    if path.suffix == ".json":
        yield from json.loads(path.read_text())
        return
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _humaneval(data_dir: Path) -> list[tuple[str, str]]:
    return [(r["task_id"], HUMANEVAL_TEMPLATE.format(r["prompt"])) for r in _records(data_dir / "HumanEval.jsonl.gz")]


def _gsm8k(data_dir: Path) -> list[tuple[str, str]]:
    return [(str(i), r["question"] + REASON_STEP_BY_STEP)
            for i, r in enumerate(_records(data_dir / "gsm8k_test.jsonl.gz"))]


def _math500(data_dir: Path) -> list[tuple[str, str]]:
    return [(r["unique_id"], r["problem"] + REASON_STEP_BY_STEP) for r in _records(data_dir / "math500_test_ori.jsonl")]


def _mbpp(data_dir: Path) -> list[tuple[str, str]]:
    return [(str(r["task_id"]), r["prompt"]) for r in _records(data_dir / "sanitized-mbpp.json")
            if r["task_id"] in MBPP_TEST_IDS]


def _first_turns(file: str, category: str | None = None) -> Callable[[Path], list[tuple[str, str]]]:
    def load(data_dir: Path) -> list[tuple[str, str]]:
        return [(str(r["question_id"]), r["turns"][0]) for r in _records(data_dir / file)
                if category is None or r["category"] == category]

    return load


LOADERS: dict[str, Callable[[Path], list[tuple[str, str]]]] = {
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "math500": _math500,
    "mbpp": _mbpp,
    "alpaca": _first_turns("eagle_alpaca_question.jsonl"),
    "spec-bench": _first_turns("spec_bench_question.jsonl"),
    **{f"spec-bench/{c}": _first_turns("spec_bench_question.jsonl", c) for c in SPEC_BENCH_CATEGORIES},
}


def load_prompts(name: str, data_dir: str | Path = DEFAULT_DATA_DIR, limit: int | None = None) -> list[Prompt]:
    """The set's prompts in file order; with `limit`, the first `limit`, cycling through the set
    when it is smaller (as DFlash's server benchmark does)."""
    return _load("prompt set", LOADERS, Prompt, name, Path(data_dir), limit)


def _load(kind: str, loaders: dict, make, name: str, data_dir: Path, limit: int | None) -> list:
    """The rows of set `name` made into `make(name, id, payload)`, in file order; with `limit`, the
    first `limit`, cycling through the set when it is smaller."""
    if name not in loaders:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(loaders)}")
    try:
        rows = loaders[name](data_dir)
    except FileNotFoundError as err:
        raise ValueError(f"{err.filename} not found: --data-dir names the folder with the prompt set's files "
                         "(README, 'Benchmark prompt sets', lists them and where they come from)") from None
    items = [make(name, id_, payload) for id_, payload in rows]
    if not items:
        raise ValueError(f"{kind} {name!r} is empty in {data_dir}")
    if limit is None:
        return items
    return [items[i % len(items)] for i in range(limit)]


def _sharegpt_two_turns(data_dir: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The first two user turns of each ShareGPT conversation that opens with a user turn followed
    by an answer and a second user turn (the answers come from the server, not ShareGPT)."""
    conversations = []
    for r in _records(data_dir / "sharegpt_sample4k.jsonl.gz"):
        turns = r.get("conversations") or []
        roles = [t.get("from") for t in turns[:3]]
        if roles != ["human", "gpt", "human"]:
            continue
        first, second = turns[0]["value"].strip(), turns[2]["value"].strip()
        if first and second and max(len(first), len(second)) <= MAX_TURN_CHARS:
            conversations.append((str(r["id"]), (first, second)))
    return conversations


CONVERSATION_LOADERS: dict[str, Callable[[Path], list[tuple[str, tuple[str, ...]]]]] = {
    "sharegpt-2turn": _sharegpt_two_turns,
}


def load_conversations(name: str, data_dir: str | Path = DEFAULT_DATA_DIR,
                       limit: int | None = None) -> list[Conversation]:
    """The set's conversations in file order; with `limit`, the first `limit` (cycled when the set
    is smaller, as load_prompts)."""
    return _load("conversation set", CONVERSATION_LOADERS, Conversation, name, Path(data_dir), limit)


def random_prompts(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                   decode: Callable[[list[int]], str] | None = None) -> list[Prompt]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from the vocabulary, each asking
    for `output_len` tokens (vLLM bench's `random` set, without its length spread). `decode` gives
    each its text, for backends that send text (chat messages)."""
    if min(num_prompts, input_len, output_len) < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be positive")
    if vocab_size < 1:
        raise ValueError("the random prompt set needs the model's vocabulary size")
    rows = np.random.default_rng(seed).integers(0, vocab_size, size=(num_prompts, input_len))
    prompts = []
    for i, row in enumerate(rows.tolist()):
        prompts.append(Prompt("random", str(i), decode(row) if decode else "", tuple(row), output_len))
    return prompts
