"""The router's reading of the target: the tokenizer AutoTokenizer chooses, by the class it chose
before (kept in the model cache) without importing torch, and the context length the engine takes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import transformers

from dflash_serve.services.models import target_files
from dflash_serve.services.models.target import load_target_config
from tests.served_pair import save_tiny_pair

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-classes"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), block_size=4)


def _records(cache) -> list:
    return sorted(cache.glob("*.json")) if cache.exists() else []


def test_a_later_load_takes_the_class_autotokenizer_chose_and_tokenizes_the_same(pair, cache, monkeypatch):
    target, _ = pair
    first = target_files.load_tokenizer(target)
    expected = transformers.AutoTokenizer.from_pretrained(target)
    (record,) = _records(cache)
    assert json.loads(record.read_text()) == {"module": type(expected).__module__, "name": type(expected).__qualname__}

    def no_autotokenizer(*args, **kwargs):
        raise AssertionError("AutoTokenizer chose again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_autotokenizer)
    again = target_files.load_tokenizer(target)
    assert type(again) is type(first) is type(expected)
    text = "def add(a, b):\n    return a + b  # é, ß"
    assert again.encode(text) == expected.encode(text) == first.encode(text)
    assert (again.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            == expected.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))
    assert again.get_vocab() == expected.get_vocab() and again.eos_token_id == expected.eos_token_id


def test_changed_tokenizer_files_are_chosen_for_again(pair, cache, tmp_path):
    target, _ = pair
    target_files.load_tokenizer(target)
    changed = tmp_path / "changed"
    transformers.AutoTokenizer.from_pretrained(target).save_pretrained(changed)
    shutil.copy(os.path.join(target, "config.json"), changed / "config.json")
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["model_max_length"] = 123
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    assert target_files.load_tokenizer(str(changed)).model_max_length == 123
    assert len(_records(cache)) == 2  # by the files' contents, not the folder's name alone


def test_a_kept_class_outside_transformers_is_not_imported(pair, cache):
    target, _ = pair
    target_files.load_tokenizer(target)
    (record,) = _records(cache)
    record.write_text(json.dumps({"module": "os", "name": "system"}))  # a hub's own code is AutoTokenizer's to load
    assert type(target_files.load_tokenizer(target)) is type(transformers.AutoTokenizer.from_pretrained(target))


def test_a_router_replica_imports_no_torch_once_the_class_is_kept(pair, tmp_path):
    """What a router replica imports — the app, the router, its servers, the tokenizer and the
    context length — leaves torch unimported (4–5 s of a replica's start on the H200)."""
    target, _ = pair
    code = f"""
import sys
from dflash_serve.services.models.target_files import context_length, load_tokenizer
import dflash_serve.services.app, dflash_serve.services.router.ingress, dflash_serve.services.router.openai_api
tokenizer = load_tokenizer({target!r})
print(context_length({target!r}), "torch" in sys.modules)
"""
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    length = load_target_config(target).max_position_embeddings
    assert runs == [f"{length} True\n", f"{length} False\n"]  # the first load chose through AutoTokenizer


def test_the_context_length_is_the_engines(pair, tmp_path):
    target, _ = pair
    multimodal = tmp_path / "multimodal"  # the text model's config nested in the checkpoint's
    transformers.Gemma3Config(text_config={"max_position_embeddings": 4096}).save_pretrained(multimodal)
    assert json.loads((multimodal / "config.json").read_text())["text_config"]["max_position_embeddings"] == 4096
    for folder in (target, str(multimodal)):
        assert target_files.context_length(folder) == load_target_config(folder).max_position_embeddings
    unsaid = tmp_path / "unsaid"
    unsaid.mkdir()
    config = json.loads(open(os.path.join(target, "config.json")).read())
    del config["max_position_embeddings"]
    (unsaid / "config.json").write_text(json.dumps(config))
    assert target_files.context_length(str(unsaid)) == load_target_config(str(unsaid)).max_position_embeddings
    with pytest.raises(ValueError, match="local folder, which has no revisions"):
        target_files.context_length(target, "abc")
