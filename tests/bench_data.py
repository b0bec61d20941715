"""A tiny bench-data folder in the shared files' own formats (two prompts per set), so the
loaders and `dflash bench` are tested where the real `../shared/bench-data` is absent (CI)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from dflash_serve.services.bench.prompts import MAX_TURN_CHARS, SPEC_BENCH_CATEGORIES

REAL_DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "bench-data"


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _sharegpt(id_: str, *messages: tuple[str, str]) -> dict:
    return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in messages]}


def write_tiny_bench_data(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "HumanEval.jsonl.gz", "wt") as f:
        f.write(_lines([{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n"}
                        for i in range(2)]))
    with gzip.open(folder / "gsm8k_test.jsonl.gz", "wt") as f:
        f.write(_lines([{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(2)]))
    (folder / "math500_test_ori.jsonl").write_text(
        _lines([{"unique_id": f"test/algebra/{i}.json", "problem": f"Solve $x = {i}$."} for i in range(2)]))
    # MBPP's test split is task_id 11..510: 10 and 511 belong to other splits.
    (folder / "sanitized-mbpp.json").write_text(json.dumps(
        [{"task_id": t, "prompt": f"Write a function number {t}."} for t in (10, 11, 12, 511)]))
    (folder / "eagle_alpaca_question.jsonl").write_text(
        _lines([{"question_id": i, "turns": [f"Alpaca question {i}?", "a second turn"]} for i in range(2)]))
    # ShareGPT: two conversations of two user turns and more; ones that cannot make two turns (one user
    # turn, an answer first, a turn longer than MAX_TURN_CHARS) are left out by the loader.
    with gzip.open(folder / "sharegpt_sample4k.jsonl.gz", "wt") as f:
        f.write(_lines([
            _sharegpt("c0", ("human", "Name a prime."), ("gpt", "7"), ("human", "And a larger one?"), ("gpt", "11"),
                      ("human", "Thanks")),
            _sharegpt("solo", ("human", "Just one turn."), ("gpt", "ok")),
            _sharegpt("late", ("gpt", "Hi!"), ("human", "Hello."), ("gpt", "How can I help?")),
            _sharegpt("long", ("human", "x" * (MAX_TURN_CHARS + 1)), ("gpt", "ok"), ("human", "Shorter?")),
            _sharegpt("c1", ("human", "Write a haiku."), ("gpt", "..."), ("human", "Now one about the sea.")),
        ]))
    (folder / "spec_bench_question.jsonl").write_text(_lines(
        [{"question_id": f"{c}-{i}", "category": c, "turns": [f"{c} question {i}"]}
         for c in SPEC_BENCH_CATEGORIES for i in range(2)]))
    return folder
