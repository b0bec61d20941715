"""The installed import names: the repository's services/ and kernels/ install as
`dflash_serve.services` and `dflash_serve.kernels` (pyproject.toml), never as top-level `services`
and `kernels`, which other distributions own (Hugging Face's `kernels`, which transformers finds
with `importlib.util.find_spec("kernels")`)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OLD = ("services", "kernels")
# A dotted module path under an old top-level name (not `dflash_serve.services.x`, not a file path
# such as services/app.py or layer_kernels.py, not a file name such as kernels.py).
OLD_DOTTED = re.compile(r"(?<![\w./\-$])(services|kernels)\.(?!(?:py|pyi|json|jsonl|ya?ml|md|txt|toml|proto)\b)[A-Za-z_]")
TEXT_FILES = ["README.md", "BENCHMARKS.md", "Dockerfile", "pyproject.toml", ".ci/run"]
TEXT_DIRS = ["services", "kernels", "tests", "helm", "docs"]


def test_pyproject_lists_every_package():
    """setuptools cannot discover packages under a prefix: the list is by hand, and complete."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"dflash_serve.services": "services", "dflash_serve.kernels": "kernels"}
    on_disk = {"dflash_serve." + ".".join(p.parent.relative_to(REPO).parts)
               for top in ("services", "kernels") for p in (REPO / top).rglob("*.py")}
    assert sorted(tool["packages"]) == sorted(on_disk)


def _repo_texts():
    paths = [REPO / name for name in TEXT_FILES]
    for top in TEXT_DIRS:
        paths += [p for p in (REPO / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".safetensors", ".jsonl", ".pyc")]
    for path in paths:
        if path.exists() and path != Path(__file__):
            yield path, path.read_text(errors="replace")


def test_no_old_import_names_are_left():
    """Code, tests, stubs, docs, the chart, the Dockerfile: after a merge that brought old names
    back, this lists them (the rewrite is mechanical: prefix `dflash_serve.`)."""
    found = []
    for path, text in _repo_texts():
        rel = path.relative_to(REPO)
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                found += [f"{rel}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in OLD]
        for number, line in enumerate(text.splitlines(), 1):
            if OLD_DOTTED.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "old top-level import names:\n" + "\n".join(found)


def test_only_dflash_serve_is_importable_outside_the_checkout(tmp_path):
    """From another folder (no checkout on sys.path): `dflash_serve.*` imports, the old names do not
    exist, so neither transformers' `is_kernels_available()` nor anything else can mistake ours
    for Hugging Face's `kernels`."""
    code = ("import importlib.util as u, dflash_serve.services, dflash_serve.kernels\n"
            "print([n for n in ('services', 'kernels') if u.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
