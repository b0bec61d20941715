"""Benchmark prompt sets: DFlash's own, read from local files in their published formats (the
folder is named by `--data-dir`; README, "Benchmark prompt sets", lists the files and where they
come from), and `random` token prompts of a fixed length, as vLLM's bench draws them.

Each prompt of a named set is one user message; the server (or the embedded bench) renders it with
the target's chat template and `add_generation_prompt=True`, as DFlash's benchmark does. Only the
first turn of multi-turn sets is used, as in DFlash's server benchmark.
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


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str  # the user message ("" for token prompts a backend cannot render as text)
    token_ids: tuple[int, ...] | None = None  # sent as is, no chat template (the random set)
    max_tokens: int | None = None  # this prompt's output length, over the run's --max-tokens


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
    if name not in LOADERS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(LOADERS)}")
    data_dir = Path(data_dir)
    try:
        rows = LOADERS[name](data_dir)
    except FileNotFoundError as err:
        raise ValueError(f"{err.filename} not found: --data-dir names the folder with the prompt set's files "
                         "(README, 'Benchmark prompt sets', lists them and where they come from)") from None
    prompts = [Prompt(name, id_, text) for id_, text in rows]
    if not prompts:
        raise ValueError(f"prompt set {name!r} is empty in {data_dir}")
    if limit is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(limit)]


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
