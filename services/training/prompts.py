"""Prompts for regenerating drafter training data, in DFlash's own prompt formats.

A prompt-set spec is `NAME`, `NAME:COUNT` (the first COUNT prompts of the set) or `NAME[START:STOP]`
(a slice, either end optional: `gsm8k[64:]` keeps the prompts a benchmark's first 64 use out of
training). NAME is a benchmark set of `dflash_serve.services.bench.prompts` (humaneval, gsm8k, math500, mbpp,
alpaca, spec-bench, read from the bench-data folder), one of the training-only sets below
(sharegpt, stdlib, sitepackages), or a path to a .jsonl / .jsonl.gz file with a "prompt" string
per line. Every prompt has a stable key
("<set>/<id>"), so an interrupted data generation resumes with the prompts still missing.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import sysconfig
import textwrap
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_serve.services.bench import prompts as bench

STDLIB_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
PACKAGE_SKIP = {"test", "tests", "testing", "_vendor", "vendored", "__pycache__"}
MIN_LATER_TURN_CHARS = 32


@dataclass(frozen=True)
class Prompt:
    key: str
    text: str


def _jsonl(path: Path) -> Iterator[dict]:
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _sharegpt(data_dir: Path) -> Iterator[tuple[str, str]]:
    """Every human turn of each conversation, as a prompt of its own (the answers come from the
    target, not ShareGPT); later turns that are too short to stand alone ("continue") are left out."""
    for row in _jsonl(data_dir / "sharegpt_sample4k.jsonl.gz"):
        turns = [t["value"] for t in row.get("conversations", []) if t.get("from") == "human"]
        for i, turn in enumerate(turns):
            if i == 0 or len(turn.strip()) >= MIN_LATER_TURN_CHARS:
                yield (row["id"] if i == 0 else f"{row['id']}:{i}"), turn


def _python_tasks(root: Path, skip: set[str]) -> Iterator[tuple[str, str]]:
    """HumanEval-shaped tasks from the Python sources under `root`: every public function and
    public method of a public class with a real docstring, cut right after the docstring."""
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skip & set(relative.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            candidates = [(node.name, node)] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                candidates = [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
            for name, fn in candidates:
                doc = ast.get_docstring(fn)
                if doc and len(doc) >= 40 and not fn.name.startswith("_") and len(fn.body) > 1:
                    head = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.body[0].end_lineno]))
                    yield f"{relative}:{name}", bench.HUMANEVAL_TEMPLATE.format(head)


def _stdlib(data_dir: Path) -> Iterator[tuple[str, str]]:
    """Tasks from the running Python's standard library."""
    return _python_tasks(Path(sysconfig.get_paths()["stdlib"]), STDLIB_SKIP)


def _sitepackages(data_dir: Path) -> Iterator[tuple[str, str]]:
    """Tasks from the installed third-party packages (what they are depends on the machine), in
    an order fixed by their keys' hashes, so that `sitepackages:N` spreads over every package."""
    tasks = _python_tasks(Path(sysconfig.get_paths()["purelib"]), PACKAGE_SKIP)
    return iter(sorted(tasks, key=lambda task: (zlib.crc32(task[0].encode()), task[0])))


TRAINING_SETS = {"sharegpt": _sharegpt, "stdlib": _stdlib, "sitepackages": _sitepackages}


def _prompt_set(name: str, data_dir: Path) -> Iterator[tuple[str, str]]:
    if name in TRAINING_SETS:
        return TRAINING_SETS[name](data_dir)
    if name in bench.LOADERS:
        return ((p.id, p.text) for p in bench.load_prompts(name, data_dir))
    if Path(name).is_file():
        return ((str(i), row["prompt"]) for i, row in enumerate(_jsonl(Path(name))))
    raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join([*TRAINING_SETS, *bench.LOADERS])} "
                     "or a .jsonl[.gz] file with a 'prompt' field per line")


SLICE = re.compile(r"(?P<name>.+)\[(?P<start>\d*):(?P<stop>\d*)\]")


def parse_spec(spec: str) -> tuple[str, int, int | None]:
    """(name, start, stop) of `NAME`, `NAME:COUNT` or `NAME[START:STOP]`; positions count the
    set's non-empty prompts in file order."""
    if match := SLICE.fullmatch(spec):
        return match["name"], int(match["start"] or 0), int(match["stop"]) if match["stop"] else None
    name, _, count = spec.rpartition(":") if re.fullmatch(r".+:\d+", spec) else (spec, "", "")
    return name, 0, int(count) if count else None


def load_prompts(specs: list[str], data_dir: str | Path = bench.DEFAULT_DATA_DIR) -> list[Prompt]:
    """The prompts of every spec, in order; empty and repeated texts are dropped."""
    prompts, seen = [], set()
    for spec in specs:
        name, start, stop = parse_spec(spec)
        try:
            texts = (item for item in _prompt_set(name, Path(data_dir)) if item[1].strip())
            for position, (id_, text) in enumerate(texts):
                if stop is not None and position >= stop:
                    break
                if position >= start and text not in seen:
                    seen.add(text)
                    prompts.append(Prompt(f"{Path(name).name}/{id_}", text))
        except FileNotFoundError as err:
            raise ValueError(f"{err.filename} not found: point --data-dir at the bench-data folder") from None
    return prompts


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A user turn through the target's chat template, ready for the assistant's answer (plain
    text when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer.encode(text))
