"""`dflash train` (dflash-spec §4): the block mask, the training forward against the inference path
and the spec oracle, gradients, a learnable toy, exact resume, and the trained checkpoint in the
engine, end to end through the CLI."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash_serve.kernels import rms_norm_reference
from dflash_serve.services.cli import main
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import CheckpointError, DFlashDraftConfig, DFlashDraftModel, DraftContext, TargetModel, load_drafter
from dflash_serve.services.training import TrainConfig, train
from dflash_serve.services.training.blocks import block_attention_mask, block_labels, block_loss, draft_blocks
from dflash_serve.services.training.dataset import AnchorBatch, Record, TrainingSet, read_records
from dflash_serve.services.training.prompts import _python_tasks, load_prompts
from dflash_serve.services.training.trainer import choose_mask_token_id, trainable_drafter
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import build_engine, hf_greedy
from tests.oracle.dflash_reference import reference_draft_logits
from tests.targets import tiny_target
from tests.tokenizer import train_tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


# -- (a) the §4 mask, anchors and labels ---------------------------------------------------------


def test_block_attention_mask_written_out():
    # One sequence of 4 tokens, blocks of 2 at anchors 1 and 2. Keys: context 0..3, then the slots
    # of block 0 (positions 1, 2) and of block 1 (positions 2, 3).
    mask = block_attention_mask(torch.tensor([[1, 2]]), seq_len=4, block=2)
    expected = torch.tensor([
        # ctx 0 1 2 3  b0 b0 b1 b1
        [1, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 0 (the anchor token itself: its own features are not context)
        [1, 0, 0, 0, 1, 1, 0, 0],  # block 0, slot 1
        [1, 1, 0, 0, 0, 0, 1, 1],  # block 1, slot 0 (sees context < 2, not block 0 although it overlaps)
        [1, 1, 0, 0, 0, 0, 1, 1],  # block 1, slot 1
    ], dtype=torch.bool)
    assert torch.equal(mask[0], expected)


def test_block_attention_mask_is_spec_section_4_everywhere():
    anchors = torch.tensor([[3, 7, 8, 11], [0, 5, 5, 9]])
    seq_len, block = 13, 4
    mask = block_attention_mask(anchors, seq_len, block)
    assert mask.shape == (2, 4 * block, seq_len + 4 * block)
    for n in range(2):
        for query in range(4 * block):
            a = query // block
            for key in range(seq_len + 4 * block):
                if key < seq_len:  # context: strictly before the anchor
                    expected = key < anchors[n, a]
                else:  # block slots: all of its own block, none of another
                    expected = (key - seq_len) // block == a
                assert bool(mask[n, query, key]) == expected, (n, query, key)


def _records(prompt_len: int, response_lens: list[int], seed: int = 0) -> list[Record]:
    rng = random.Random(seed)
    return [Record(f"r/{i:03d}", [rng.randrange(2, 60) for _ in range(prompt_len)],
                   [rng.randrange(2, 60) for _ in range(n)]) for i, n in enumerate(response_lens)]


def test_anchors_lie_in_the_response_and_are_redrawn_every_epoch():
    records = _records(5, [30, 3, 12, 30])
    data = TrainingSet(records, max_seq_len=64)
    seen: dict[int, list[list[int]]] = {}
    for step in range(3 * data.steps_per_epoch(2)):  # three epochs
        batch = data.batch(step, batch_size=2, anchors=8, seed=1)
        assert torch.equal(batch.input_ids, data.batch(step, 2, 8, seed=1).input_ids)  # a pure function of the step
        for row in range(batch.input_ids.shape[0]):
            length = int(batch.lengths[row])
            chosen = batch.anchors[row][batch.anchor_valid[row]].tolist()
            assert chosen == sorted(set(chosen))
            assert all(5 <= p <= length - 2 for p in chosen)  # a response token with a label after it
            assert len(chosen) == min(8, length - 1 - 5)
            assert not batch.anchor_valid[row, len(chosen):].any()
            seen.setdefault(length, []).append(chosen)
    assert seen[8] == [[5, 6]] * 3  # the 3-token response has exactly two anchors
    assert len({tuple(a) for a in seen[17]}) == 3  # re-drawn each epoch


def test_labels_are_the_tokens_after_the_anchor_and_padding_never_counts():
    ids = torch.tensor([[100 + i for i in range(12)], [200 + i for i in range(12)]])
    batch = AnchorBatch(ids, torch.tensor([12, 7]), torch.tensor([[2, 9], [4, 0]]),
                        torch.tensor([[True, True], [True, False]]))
    labels, valid = block_labels(batch, block=4)
    for n in range(2):
        for a in range(2):
            p = int(batch.anchors[n, a])
            for k in range(1, 4):
                real = bool(batch.anchor_valid[n, a]) and p + k < int(batch.lengths[n])
                assert bool(valid[n, a, k - 1]) == real
                if real:
                    assert labels[n, a, k - 1] == ids[n, p + k]

    # Whatever sits in the padding, the loss is the same: no query sees it and no label is in it.
    cfg = drafter_config(vocab_size=96, block_size=4, num_hidden_layers=1, layer_types=["full_attention"],
                         dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 3]})
    drafter = random_drafter(cfg, seed=5)
    target = TargetModel(tiny_target("llama"), drafter.config.target_layer_ids)
    tokens = torch.randint(0, 90, (2, 12))
    scrambled = tokens.clone()
    scrambled[1, 7:] = torch.randint(0, 90, (5,))
    losses = []
    for input_ids in (tokens, scrambled):
        batch = AnchorBatch(input_ids, torch.tensor([12, 7]), torch.tensor([[2, 9], [4, 0]]),
                            torch.tensor([[True, True], [True, False]]))
        features = target.forward_with_features(input_ids)[1]
        losses.append(block_loss(drafter, target, draft_blocks(drafter, target, batch, features), batch, 7.0)[0])
    assert torch.equal(losses[0], losses[1])


def test_loss_is_the_position_weighted_cross_entropy_of_the_real_labels():
    cfg = drafter_config(block_size=4, num_hidden_layers=1, layer_types=["full_attention"],
                         dflash_config={"target_layer_ids": [1, 3]})
    drafter = random_drafter(cfg, seed=2)
    target = TargetModel(tiny_target("qwen3"), drafter.config.target_layer_ids)
    ids = torch.randint(0, 90, (2, 10))
    batch = AnchorBatch(ids, torch.tensor([10, 8]), torch.tensor([[2, 7], [5, 1]]),
                        torch.tensor([[True, True], [True, False]]))
    hidden = draft_blocks(drafter, target, batch, target.forward_with_features(ids)[1])
    loss, _ = block_loss(drafter, target, hidden, batch, gamma=2.0)
    total = weights = 0.0
    for n, a, k in [(0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 1), (0, 1, 2), (1, 0, 1), (1, 0, 2)]:  # the real labels
        p = int(batch.anchors[n, a])
        logits = drafter.logits(target, hidden[n, a, k])
        w = math.exp(-(k - 1) / 2.0)
        total += w * torch.nn.functional.cross_entropy(logits[None], ids[n, p + k][None]).item()
        weights += w
    assert loss.item() == pytest.approx(total / weights, rel=1e-6)  # the loss is taken in float32


# -- (b) training forward == inference path, block by block ---------------------------------------


TRAINING_CONFIGS = {
    "full_bidirectional_b8": ("qwen3", {"block_size": 8}),
    "sliding_causal_window_6": ("llama", {"block_size": 6, "num_hidden_layers": 3, "sliding_window": 6,
                                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                          "dflash_config": {"target_layer_ids": [1, 4, 6]}}),
    "newest_reference_fields": ("qwen3", {"block_size": 5, "is_causal": True,
                                          "dflash_config": {"input_embedding_scale": 1.5, "output_multiplier": 0.75,
                                                            "final_logit_softcapping": 20.0}}),
}


@pytest.mark.parametrize("name", sorted(TRAINING_CONFIGS))
def test_training_logits_equal_inference_logits_for_every_block(name):
    family, overrides = TRAINING_CONFIGS[name]
    cfg = drafter_config(**overrides)
    drafter = random_drafter(cfg, seed=len(name))
    target = TargetModel(tiny_target(family), drafter.config.target_layer_ids)
    block = drafter.config.block_size
    ids = torch.randint(0, 90, (2, 30))
    # Overlapping, adjacent and end-running blocks; one padding anchor.
    batch = AnchorBatch(ids, torch.tensor([30, 22]), torch.tensor([[4, 5, 17, 28], [9, 12, 20, 0]]),
                        torch.tensor([[True, True, True, True], [True, True, True, False]]))
    with torch.no_grad():
        features = target.forward_with_features(ids)[1]
        trained = drafter.logits(target, draft_blocks(drafter, target, batch, features)[:, :, 1:])
        for n, a in batch.anchor_valid.nonzero().tolist():
            p = int(batch.anchors[n, a])
            # At inference the target has seen exactly the committed tokens before the bonus token.
            prefix = target.forward_with_features(ids[n : n + 1, :p])[1]
            positions = torch.arange(p)[None]
            context = DraftContext(drafter.context_kv(prefix, positions), positions, torch.ones(1, p, dtype=torch.bool))
            inferred = drafter.draft_logits(target, ids[n, p : p + 1], torch.tensor([p]), context)[0]
            torch.testing.assert_close(trained[n, a], inferred, rtol=1e-9, atol=1e-9)
            oracle = reference_draft_logits(
                cfg, drafter.state_dict(), target.input_embeddings.weight, drafter.config.input_embedding_scale or 1.0,
                target.lm_head.weight, drafter.config.final_logit_softcapping, drafter.config.output_multiplier,
                prefix[0], int(ids[n, p]), p)
            torch.testing.assert_close(trained[n, a], oracle, rtol=1e-6, atol=1e-9)
    assert trained.shape == (2, 4, block - 1, 96)


# -- gradients -----------------------------------------------------------------------------------


def test_every_weight_gets_a_gradient_even_where_the_norm_kernel_has_no_backward(monkeypatch):
    def norm_kernel_without_backward(x, weight, eps):  # what the fused Triton RMSNorm is to autograd
        with torch.no_grad():
            return rms_norm_reference(x, weight, eps)

    monkeypatch.setattr("dflash_serve.services.models.draft.rms_norm", norm_kernel_without_backward)
    cfg = DFlashDraftConfig.from_dict(drafter_config(block_size=4, num_hidden_layers=2,
                                                     layer_types=["full_attention"] * 2))
    target = TargetModel(tiny_target("qwen3").float(), cfg.target_layer_ids)
    ids = torch.randint(0, 90, (1, 16))
    batch = AnchorBatch(ids, torch.tensor([16]), torch.tensor([[3, 9]]), torch.ones(1, 2, dtype=torch.bool))
    features = target.forward_with_features(ids)[1]

    def gradients(drafter: DFlashDraftModel) -> dict[str, torch.Tensor | None]:
        block_loss(drafter, target, draft_blocks(drafter, target, batch, features), batch, 7.0)[0].backward()
        return {name: p.grad for name, p in drafter.named_parameters()}

    assert all(g is not None and g.abs().sum() > 0 for g in gradients(trainable_drafter(cfg)).values())
    assert gradients(DFlashDraftModel(cfg))["fc.weight"] is None  # what training through the kernel would do


# -- (c) the loss falls; (d) resume --------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings large enough that copying a token is learnable fast."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.15)
    folder = tmp_path_factory.mktemp("toy_target")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _write_answers(folder: Path, records: list[Record]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "answers.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"key": r.key, "prompt_ids": r.prompt_ids, "response_ids": r.response_ids}) + "\n")


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in open(folder / "train_log.jsonl")]


def _toy_config(target: Path, output: Path, **overrides) -> TrainConfig:
    settings = dict(target=str(target), output=str(output), stage="train", block_size=8, num_layers=2,
                    mask_token_id=63, batch_size=8, anchors=16, max_seq_len=64, eval_prompts=0, device="cpu")
    return TrainConfig(**{**settings, **overrides})


def test_loss_falls_clearly_on_a_learnable_toy(toy_target, tmp_path):
    # Every answer repeats one token: each block slot must copy the anchor token through the frozen head.
    rng = random.Random(0)
    _write_answers(tmp_path, [Record(f"toy/{i}", [rng.randrange(2, 60) for _ in range(6)], [rng.randrange(2, 60)] * 40)
                           for i in range(64)])
    train(_toy_config(toy_target, tmp_path, lr=1e-2, epochs=6, eval_every=4))
    log = [e for e in _log(tmp_path) if "loss" in e]
    assert log[-1]["step"] == 48
    first, final = log[0]["loss"], (log[-1]["loss"] + log[-2]["loss"]) / 2
    assert final < 0.6 * first, [e["loss"] for e in log]
    assert log[-1]["block_tau"] > 3  # drafted blocks are mostly right, not just less wrong


def test_resume_continues_exactly_where_it_stopped(toy_target, tmp_path):
    _write_answers(tmp_path / "straight", _records(6, [40] * 16 + [9] * 8))
    _write_answers(tmp_path / "resumed", _records(6, [40] * 16 + [9] * 8))
    common = dict(lr=3e-3, epochs=2, batch_size=4, eval_every=0)  # 12 steps; warmup and cosine both matter
    train(_toy_config(toy_target, tmp_path / "straight", **common))
    train(_toy_config(toy_target, tmp_path / "resumed", stop_after_steps=5, **common))
    with pytest.raises(ValueError, match="pass --resume"):
        train(_toy_config(toy_target, tmp_path / "resumed", **common))
    assert torch.load(tmp_path / "resumed" / "training_state.pt")["step"] == 5
    train(_toy_config(toy_target, tmp_path / "resumed", resume=True, **common))

    straight = torch.load(tmp_path / "straight" / "training_state.pt")
    resumed = torch.load(tmp_path / "resumed" / "training_state.pt")
    assert straight["step"] == resumed["step"] == 12
    for name, weight in straight["drafter"].items():
        assert torch.equal(weight, resumed["drafter"][name]), name
    for moments, other in zip(straight["optimizer"]["state"].values(), resumed["optimizer"]["state"].values()):
        assert all(torch.equal(torch.as_tensor(moments[k]), torch.as_tensor(other[k])) for k in moments)
    exported = [load_file(tmp_path / run / "model.safetensors") for run in ("straight", "resumed")]
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])

    with open(tmp_path / "resumed" / "answers.jsonl", "a") as f:  # the data changed under the run
        f.write(json.dumps({"key": "r/zzz", "prompt_ids": [2] * 6, "response_ids": [3] * 20}) + "\n")
    with pytest.raises(ValueError, match="changed since this run started"):
        train(_toy_config(toy_target, tmp_path / "resumed", resume=True, **common))


def test_sigterm_ends_the_invocation_with_a_checkpoint_that_resume_continues(toy_target, tmp_path, monkeypatch):
    _write_answers(tmp_path, _records(6, [40] * 16))
    common = dict(lr=3e-3, epochs=2, batch_size=4, eval_every=0)  # 8 steps
    batch = TrainingSet.batch

    def preempted_at_step_3(self, step, *args):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` or a Kubernetes eviction sends it
        return batch(self, step, *args)

    monkeypatch.setattr(TrainingSet, "batch", preempted_at_step_3)
    before = signal.getsignal(signal.SIGTERM)
    train(_toy_config(toy_target, tmp_path, **common))
    assert torch.load(tmp_path / "training_state.pt")["step"] == 4  # the step in flight finished
    assert (tmp_path / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) is before

    monkeypatch.setattr(TrainingSet, "batch", batch)
    train(_toy_config(toy_target, tmp_path, resume=True, **common))
    assert torch.load(tmp_path / "training_state.pt")["step"] == 8


def test_init_from_starts_a_new_run_at_a_drafters_weights_and_architecture(toy_target, tmp_path):
    _write_answers(tmp_path / "first", _records(6, [40] * 16))
    train(_toy_config(toy_target, tmp_path / "first", lr=3e-3, epochs=1, batch_size=4, eval_every=0))
    _write_answers(tmp_path / "more", _records(6, [30] * 16, seed=1))
    # The drafter flags of a fresh run (here 1 layer, block 4) give way to the checkpoint's.
    settings = dict(lr=3e-3, epochs=1, batch_size=4, eval_every=0, num_layers=1, block_size=4)
    train(_toy_config(toy_target, tmp_path / "more", init_from=str(tmp_path / "first"), stop_after_steps=0, **settings))
    source, started = (load_file(tmp_path / run / "model.safetensors") for run in ("first", "more"))
    assert source.keys() == started.keys() and all(torch.equal(source[k], started[k]) for k in source)
    assert json.load(open(tmp_path / "more" / "config.json"))["block_size"] == 8

    train(_toy_config(toy_target, tmp_path / "more", init_from=str(tmp_path / "first"), resume=True, **settings))
    trained = load_file(tmp_path / "more" / "model.safetensors")
    assert any(not torch.equal(source[k], trained[k]) for k in source)  # and it trains from there

    with pytest.raises(CheckpointError, match="does not exist"):
        train(_toy_config(toy_target, tmp_path / "other", init_from=str(tmp_path / "missing")))
    assert not (tmp_path / "other").exists()  # a failed start leaves no empty output folder


def test_a_target_that_cannot_be_loaded_is_a_clear_error_and_leaves_nothing(tmp_path, capsys):
    # A fresh run reads the target's config first (to size the drafter): that read must fail as clearly as loading it.
    out = tmp_path / "run"
    assert main(["train", "--target", str(tmp_path / "missing"), "--output", str(out), "--stage", "train"]) == 2
    assert f"cannot load target '{tmp_path / 'missing'}'" in capsys.readouterr().err
    assert not out.exists()


# -- (e) end to end: regenerate with the engine, train, serve the checkpoint ----------------------


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """A tiny Llama with a real BPE tokenizer and a chat template; its embedding table has 4 rows
    more than the tokenizer (as Qwen3's does), so the mask token is the first spare row, 300."""
    folder = tmp_path_factory.mktemp("chat_target")
    tiny_target("llama", layers=4, vocab=304, seed=3).save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(300), eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    with open(folder / "prompts.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"prompt": f"def item_{i}(x):\n    return x + {i}"}) + "\n")
    return folder


def test_cli_regenerates_trains_and_writes_a_checkpoint_the_engine_serves(chat_target, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--target", str(chat_target), "--output", str(out),
            "--prompts", str(chat_target / "prompts.jsonl"),
            "--max-new-tokens", "12", "--max-seq-len", "96", "--block-size", "4", "--num-layers", "1",
            "--num-features", "2", "--batch-size", "4", "--anchors", "4", "--epochs", "2", "--eval-every", "2",
            "--eval-prompts", "2", "--eval-max-tokens", "10", "--device", "cpu",
            "--gen-batch", "3"]  # 10 prompts admitted in waves
    assert main([*args, "--stage", "data"]) == 0
    assert len(read_records(out / "answers.jsonl")) == 10
    answers = out / "answers.jsonl"
    complete = answers.read_text().splitlines(keepends=True)
    answers.write_text("".join(complete[:6]) + complete[6][:20])  # generation cut off while writing line 7
    assert main(args) == 0  # regenerates what is missing, then trains

    # The data is the target's own greedy answer to each chat-formatted prompt, each prompt once.
    model = LlamaForCausalLM.from_pretrained(chat_target).float().eval()
    records = read_records(answers)
    assert sorted(answers.read_text().splitlines()) == sorted(line.rstrip("\n") for line in complete)
    for r in records[:3]:
        assert r.response_ids == hf_greedy(model, r.prompt_ids, len(r.response_ids))
        assert len(r.response_ids) == 12 or r.response_ids[-1] == 0  # max tokens, or ended by <eos>

    # Held-out τ was measured from the start (untrained: ~1) to the end; 8 training prompts, 2 held out.
    log = _log(out)
    assert [e["step"] for e in log] == [0, 2, 4]
    assert all(1.0 <= e["tau"] <= 4.0 and len(e["acceptance_per_position"]) == 3 for e in log)

    drafter = load_drafter(out, dtype=torch.float32)
    cfg = drafter.config
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.mask_token_id, cfg.target_layer_ids) == (4, 1, 300, (1, 1))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    engine = build_engine(model, drafter=drafter)
    prompts = [r.prompt_ids for r in records[:2]]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_ids == hf_greedy(model, prompt, 10)  # lossless with the trained drafter
        assert seq.stats.rounds > 0

    assert main(args) == 2  # the run exists: it must be resumed explicitly, never overwritten


def test_sampled_answers_join_the_greedy_ones_in_one_file(chat_target, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--target", str(chat_target), "--output", str(out), "--stage", "data",
            "--prompts", f"{chat_target / 'prompts.jsonl'}[:4]", "--max-new-tokens", "8", "--max-seq-len", "96",
            "--device", "cpu"]
    assert main(args) == 0
    greedy = {r.key: r.response_ids for r in read_records(out / "answers.jsonl")}
    assert sorted(greedy) == [f"prompts.jsonl/{i}" for i in range(4)]
    assert main([*args, "--samples-per-prompt", "3"]) == 2  # greedy samples would all be the same

    assert main([*args, "--samples-per-prompt", "3", "--gen-temperature", "1.0"]) == 0
    records = {r.key: r for r in read_records(out / "answers.jsonl")}
    assert sorted(records) == sorted(f"{k}{s}" for k in greedy for s in ("", "#1", "#2"))
    assert {k: records[k].response_ids for k in greedy} == greedy  # the greedy answers stay answer 0
    samples = [records[f"{k}#{s}"].response_ids for k in greedy for s in (1, 2)]
    assert len({tuple(ids) for ids in samples}) > 1  # sampled, each with its own seed
    assert all(records[f"{k}#1"].prompt_ids == records[k].prompt_ids for k in greedy)


# -- prompts and the mask token ------------------------------------------------------------------


def test_prompt_specs_limit_and_keep_stable_keys(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a", "b", "a", " ", "c"]))
    prompts = load_prompts([f"{path}:2", "stdlib:3"])
    assert [p.key for p in prompts[:2]] == ["mine.jsonl/0", "mine.jsonl/1"]
    assert [p.text for p in prompts[:2]] == ["a", "b"]
    # A slice counts non-empty prompts in file order, so `gsm8k[64:]` skips what `--num-prompts 64` benchmarks.
    assert [(p.key, p.text) for p in load_prompts([f"{path}[2:]"])] == [("mine.jsonl/2", "a"), ("mine.jsonl/4", "c")]
    assert [p.text for p in load_prompts([f"{path}[:2]", f"{path}[1:3]"])] == ["a", "b"]  # repeats dropped
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts(["gsm8k[1:x]"])
    for p in prompts[2:]:  # HumanEval-shaped tasks cut from the standard library, right after the docstring
        assert p.key.startswith("stdlib/") and p.text.count("```") == 2
        assert "\ndef " in p.text and p.text.rstrip("`\n").rstrip().endswith(('"""', "'''"))


def test_python_tasks_take_public_functions_and_methods_cut_after_the_docstring(tmp_path):
    doc = '"""' + "Return the thing, documented at length enough to count as a real docstring." + '"""'
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        f"def top(x):\n    {doc}\n    return x\n\n"
        f"def _private(x):\n    {doc}\n    return x\n\n"
        f"def short(x):\n    {doc}\n\n"  # nothing after the docstring: nothing to learn
        f"class Thing:\n    def method(self):\n        {doc}\n        return 1\n\n"
        f"    def _hidden(self):\n        {doc}\n        return 2\n\n"
        f"class _Private:\n    def method(self):\n        {doc}\n        return 3\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(f"def test_it():\n    {doc}\n    pass\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    tasks = dict(_python_tasks(tmp_path, {"tests"}))
    assert sorted(tasks) == ["pkg/mod.py:Thing.method", "pkg/mod.py:top"]
    method = tasks["pkg/mod.py:Thing.method"]
    assert "\ndef method(self):\n    " in method and "return 1" not in method  # dedented, cut after the docstring


def test_sharegpt_prompts_are_every_human_turn_that_stands_alone(tmp_path):
    rows = [{"id": "a", "conversations": [
        {"from": "human", "value": "first question"}, {"from": "gpt", "value": "answer"},
        {"from": "human", "value": "continue"},
        {"from": "human", "value": "a later question, long enough to be asked on its own"}]},
            {"id": "b", "conversations": []}]
    with gzip.open(tmp_path / "sharegpt_sample4k.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts(["sharegpt"], tmp_path)
    assert [(p.key, p.text) for p in prompts] == [
        ("sharegpt/a", "first question"), ("sharegpt/a:2", "a later question, long enough to be asked on its own")]


def test_mask_token_is_a_spare_row_or_a_special_token_chat_never_uses():
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(300), eos_token="<eos>")
    assert choose_mask_token_id(tokenizer, 304) == 300
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<unused>"]})
    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    assert tokenizer.convert_ids_to_tokens(choose_mask_token_id(tokenizer, len(tokenizer))) == "<unused>"
    tokenizer.chat_template = "{% for m in messages %}<|user|><unused><stop>{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token_id(tokenizer, len(tokenizer))
