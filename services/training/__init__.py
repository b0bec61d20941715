"""Drafter training (`dflash train`, dflash-spec §4): the target's own answers as data, all
anchored blocks of a sequence in one forward with the §4 mask, position-weighted cross-entropy,
a z-lab checkpoint out."""

from dflash_serve.services.training.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
