"""`dflash inspect`: describes a real checkpoint folder and checks it against a real target folder."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dflash_serve.services.cli import main
from dflash_serve.services.cli.serve import run_until_stopped
from dflash_serve.services.models import save_drafter
from tests.conftest import drafter_config, random_drafter
from tests.targets import tiny_target


def test_inspect_describes_the_drafter_and_checks_the_target(tmp_path, capsys):
    drafter_dir = save_drafter(random_drafter(drafter_config(), dtype=torch.bfloat16), tmp_path / "drafter")
    target_dir = tmp_path / "target"
    tiny_target("qwen3").save_pretrained(target_dir)
    assert main(["inspect", str(drafter_dir), "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    assert "block size       16 (drafts 15 tokens per round)" in out
    assert "target layers    [1, 2, 4, 5, 6] (F=5)" in out
    assert "8 layers, 96 embedding rows - compatible" in out


def test_inspect_reports_an_incompatible_target(tmp_path, capsys):
    drafter_dir = save_drafter(random_drafter(drafter_config(dflash_config={"mask_token_id": 500})), tmp_path / "d")
    target_dir = tmp_path / "target"
    tiny_target("llama").save_pretrained(target_dir)
    assert main(["inspect", str(drafter_dir), "--target", str(target_dir)]) == 2
    assert "mask_token_id=500 is not a row of the target embedding" in capsys.readouterr().err


def test_inspect_reports_a_missing_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_prints_text_tau_and_acceptance_and_matches_target_only(tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    from tests.tokenizer import train_tiny_tokenizer

    vocab = 600
    target_dir = tmp_path / "target"
    tiny_target("llama", layers=4, vocab=vocab, seed=3).save_pretrained(target_dir)
    PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(vocab), eos_token="<eos>").save_pretrained(target_dir)
    cfg = drafter_config(vocab_size=vocab, num_target_layers=4, block_size=8,
                         dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [0, 1, 2, 3, 3]})
    drafter_dir = save_drafter(random_drafter(cfg, dtype=torch.float32), tmp_path / "drafter")
    common = ["--target", str(target_dir), "--prompt", "def main():", "--max-tokens", "24", "--device", "cpu", "--raw"]

    assert main(["generate", *common, "--drafter", str(drafter_dir)]) == 0
    spec = capsys.readouterr()
    assert "-- tau (mean accepted length incl. bonus)" in spec.err
    assert "-- acceptance per draft position:" in spec.err
    assert main(["generate", *common]) == 0
    plain = capsys.readouterr()
    assert spec.out == plain.out and spec.out.strip()  # lossless: the same text as target-only decoding


def test_generate_refuses_bad_sampling_parameters(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path), "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_on_sigint_and_sigterm_and_a_second_signal_forces(sig):
    """`dflash serve` waits in run_until_stopped; Kubernetes stops pods with SIGTERM, a terminal with SIGINT."""
    before = signal.getsignal(sig)
    threading.Timer(0.3, os.kill, (os.getpid(), sig)).start()
    start = time.monotonic()
    run_until_stopped()
    assert time.monotonic() - start < 2.0
    assert signal.getsignal(sig) is before  # a second one during shutdown acts as it did before


def test_the_cli_starts_without_torch_and_picks_the_device_torch_would():
    """`dflash serve` (whose engine runs in other processes), `client` and the rest import torch
    only when a command needs it: 1.5-2 s off every start. The device it picks without torch is
    the one torch picks."""
    import subprocess
    import sys

    code = ("import sys; from dflash_serve.services.cli import build_parser; from dflash_serve.services.cli.flags "
            "import auto_device; build_parser(); print(auto_device(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["cuda" if torch.cuda.is_available() else "cpu", "False"]
