"""A real byte-level BPE tokenizer, trained offline on a few stdlib files (no hub here)."""

from __future__ import annotations

import os
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train_tiny_tokenizer(vocab_size: int = 600) -> Tokenizer:
    """ASCII merges, and every non-ASCII character split into single-byte tokens; the special
    tokens <eos> (id 0) and <stop> (id 1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<stop>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    stdlib = sysconfig.get_paths()["stdlib"]
    tok.train([os.path.join(stdlib, name) for name in ("textwrap.py", "string.py", "this.py")], trainer)
    return tok
