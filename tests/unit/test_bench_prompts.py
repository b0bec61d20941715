"""The bench prompt sets in DFlash's formats: the loaders on a tiny folder in the files' own
formats (always), and the facts of the real shared bench-data files (where they are present)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_serve.services.bench.prompts import HUMANEVAL_TEMPLATE, LOADERS, SPEC_BENCH_CATEGORIES, load_prompts
from tests.bench_data import REAL_DATA_DIR as DATA_DIR
from tests.bench_data import write_tiny_bench_data

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# These check the real files' sizes and first prompts; the formats are checked without them below.
needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"no bench data at {DATA_DIR}")


def test_every_loader_reads_its_format(tmp_path):
    folder = write_tiny_bench_data(tmp_path / "bench-data")
    texts = {name: [(p.id, p.text) for p in load_prompts(name, folder)] for name in LOADERS}
    assert texts["humaneval"][0] == ("HumanEval/0", HUMANEVAL_TEMPLATE.format('def f0(x):\n    """Return x."""\n'))
    assert texts["gsm8k"] == [("0", "What is 0 + 1?" + BOXED), ("1", "What is 1 + 1?" + BOXED)]
    assert texts["math500"][1] == ("test/algebra/1.json", "Solve $x = 1$." + BOXED)
    assert texts["mbpp"] == [("11", "Write a function number 11."), ("12", "Write a function number 12.")]
    assert texts["alpaca"] == [("0", "Alpaca question 0?"), ("1", "Alpaca question 1?")]
    assert len(texts["spec-bench"]) == 2 * len(SPEC_BENCH_CATEGORIES)
    assert texts["spec-bench/qa"] == [("qa-0", "qa question 0"), ("qa-1", "qa question 1")]


def first(name: str) -> str:
    return load_prompts(name, DATA_DIR)[0].text


@needs_data
def test_every_set_has_its_known_size():
    sizes = {name: len(load_prompts(name, DATA_DIR)) for name in LOADERS}
    assert sizes == {"humaneval": 164, "gsm8k": 1319, "math500": 500, "mbpp": 257, "alpaca": 80, "spec-bench": 400,
                     **{f"spec-bench/{c}": 80 for c in SPEC_BENCH_CATEGORIES}}


@needs_data
def test_humaneval_wraps_the_prompt_in_a_python_fence():
    text = first("humaneval")
    assert text.startswith("Write a solution to the following problem and make sure that it passes the tests:\n"
                           "```python\nfrom typing import List\n\n\ndef has_close_elements(numbers: List[float], ")
    assert text.endswith("    True\n    \"\"\"\n\n```")  # the prompt's own trailing newline, then the fence


@needs_data
def test_gsm8k_and_math500_ask_for_a_boxed_answer():
    assert first("gsm8k") == (
        "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
        "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
        "How much in dollars does she make every day at the farmers' market?" + BOXED)
    math = load_prompts("math500", DATA_DIR)[0]
    assert math.id == "test/precalculus/807.json"
    assert math.text.startswith("Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.")
    assert math.text.endswith("$0 \\le \\theta < 2 \\pi.$" + BOXED)


@needs_data
def test_mbpp_is_the_raw_prompt_of_the_test_split():
    prompts = load_prompts("mbpp", DATA_DIR)
    assert prompts[0].id == "11" and all(11 <= int(p.id) <= 510 for p in prompts)
    assert prompts[0].text == (
        "Write a python function to remove first and last occurrence of a given character from the string.")


@needs_data
def test_alpaca_and_spec_bench_are_the_first_turn():
    assert first("alpaca") == "What would be the best type of exercise for a person who has arthritis?"
    qa = load_prompts("spec-bench/qa", DATA_DIR)
    assert qa[0].text == "Who played anna in once upon a time?" and qa[0].dataset == "spec-bench/qa"
    assert first("spec-bench").startswith("Translate German to English: Pfandh\u00e4user boomen in Singapur")


def test_a_limit_takes_the_first_prompts_and_cycles_past_the_end(tmp_path):
    folder = write_tiny_bench_data(tmp_path / "bench-data")
    alpaca = load_prompts("alpaca", folder)
    assert load_prompts("alpaca", folder, limit=1) == alpaca[:1]
    assert load_prompts("alpaca", folder, limit=5) == alpaca + alpaca + alpaca[:1]


def test_errors_name_the_set_or_the_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt set 'gsm9k'; known: humaneval, gsm8k"):
        load_prompts("gsm9k", tmp_path)
    with pytest.raises(ValueError, match="HumanEval.jsonl.gz not found: --data-dir names the folder with the prompt set.s files"):
        load_prompts("humaneval", tmp_path)
