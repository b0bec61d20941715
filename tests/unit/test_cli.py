"""`dflash inspect`: describes a real checkpoint folder and checks it against a real target folder."""

from __future__ import annotations

import torch

from services.cli import main
from services.models import save_drafter
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
