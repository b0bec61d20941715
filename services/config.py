"""The one typed configuration of dflash-serve.

Every knob lives here once, with its default; the CLI maps flags onto it (and, with the server,
a YAML file and the Helm chart render the same fields).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """The speculative engine: models, KV cache and scheduler limits."""

    target: str = ""
    # None: target-only (autoregressive) decoding, the baseline every speedup is measured against.
    drafter: str | None = None
    device: str = "cpu"
    # "auto" = the checkpoint's own dtype on GPU, float32 on CPU (bf16 matmuls are slow there).
    dtype: str = "auto"
    # Tokens per KV block, shared by the target and drafter pools (one block table per sequence).
    kv_block_size: int = 16
    # KV blocks per pool; 0 = size from kv_memory_fraction of free GPU memory (or 4096 on CPU).
    num_kv_blocks: int = 0
    kv_memory_fraction: float = 0.85
    max_num_seqs: int = 32
    # Prompt tokens per step; longer prompts are prefilled in chunks so running requests keep going.
    max_prefill_tokens: int = 2048
    # 0 = the target's max_position_embeddings.
    max_model_len: int = 0
    max_tokens_limit: int = 32768
    # Capture CUDA graphs for the fixed-shape decode, verify and draft forwards (GPU only).
    cuda_graphs: bool = True

    def validate(self) -> None:
        if not self.target:
            raise ValueError("EngineConfig.target is empty: name a target model folder or hub repo id")
        if self.kv_block_size <= 0 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size={self.kv_block_size} must be a positive power of two")
        if self.max_num_seqs <= 0 or self.max_prefill_tokens <= 0:
            raise ValueError("max_num_seqs and max_prefill_tokens must be positive")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
