"""A tiny served model pair on disk: a target with a trained tokenizer and a chat template, and a
random DFlash drafter in the z-lab format; what the server and the load benchmark are tested with."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import drafter_config, random_drafter
from tests.targets import tiny_target
from tests.tokenizer import train_tiny_tokenizer

VOCAB = 600
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_pair(root: Path, *, block_size: int) -> tuple[str, str]:
    """Writes root/target and root/drafter; returns their paths."""
    from transformers import PreTrainedTokenizerFast

    from dflash_serve.services.models import save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    tiny_target("llama", layers=4, vocab=VOCAB, seed=21).save_pretrained(target_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB), eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target_dir)
    cfg = drafter_config(vocab_size=VOCAB, num_target_layers=4, num_hidden_layers=2, block_size=block_size,
                         layer_types=["full_attention"] * 2,
                         dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]})
    save_drafter(random_drafter(cfg, seed=4, dtype=torch.float32), drafter_dir)
    return str(target_dir), str(drafter_dir)


def save_gemma4_pair(root: Path, *, block_size: int) -> tuple[str, str]:
    """google/gemma-4-31B's structure at toy size (tests/targets.py) with the tokenizer and chat
    template above, and a drafter of the z-lab Gemma-4 layout; returns their paths."""
    from transformers import PreTrainedTokenizerFast

    from dflash_serve.services.models import save_drafter
    from tests.conftest import gemma4_drafter
    from tests.targets import gemma4_31b_twin

    target_dir, drafter_dir = root / "gemma4-target", root / "gemma4-drafter"
    gemma4_31b_twin(seed=3, vocab_size=VOCAB).save_pretrained(target_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB), eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target_dir)
    save_drafter(gemma4_drafter(block_size=block_size, seed=4, vocab_size=VOCAB), drafter_dir)
    return str(target_dir), str(drafter_dir)


async def run_request(verifier, prompt_ids: list[int], params, request_id: str = "r") -> list:
    """One request through a Verifier in this process as a router sends it: the outputs that
    arrive over the router's output stream, up to the finished one."""
    from dflash_serve.services.verifier.output_stream import OutputListener

    listener = OutputListener()
    queue = listener.open(request_id)
    await verifier.generate(prompt_ids, params, request_id, await listener.reply_to())
    outputs = [await queue.get()]
    while not outputs[-1].finished:
        outputs.append(await queue.get())
    await listener.aclose()
    return outputs
