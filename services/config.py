"""The one typed configuration of dflash-serve.

Every knob lives here once, with its default; the CLI maps flags onto it (and, with the server,
a YAML file and the Helm chart render the same fields).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


TARGET_IMPLS = ("auto", "fused", "transformers")


@dataclass(frozen=True)
class EngineConfig:
    """The speculative engine: models, KV cache and scheduler limits."""

    target: str = ""
    # None: target-only (autoregressive) decoding, the baseline every speedup is measured against.
    drafter: str | None = None
    # The hub revision (commit sha or tag) of a target / drafter given as a hub repo id; None: the
    # repo's default branch. Pin both in production: published drafters are retrained in place
    # under the same repo id, so an unpinned restart can silently change acceptance. A local
    # folder has no revisions: setting one for a folder is refused when the model loads.
    target_revision: str | None = None
    drafter_revision: str | None = None
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
    # The target's forward: fused (our layer code and kernels: Llama, Qwen2, Qwen3 dense),
    # transformers (its own layer code, any causal LM), or auto (fused where it applies).
    target_impl: str = "auto"
    # Launch each round before the host has read the last one's results, so sampling, stop
    # checks and streaming overlap the GPU's work (with CUDA graphs and an in-process drafter, or
    # none). Off: one host sync between rounds.
    async_scheduling: bool = True
    # Keep full KV blocks of committed tokens (the target's and the drafter's) keyed by content,
    # shared between requests and kept after they finish until evicted: a prompt that starts
    # like an earlier one (a system prompt, the conversation so far) skips prefilling that part.
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if not self.target:
            raise ValueError("EngineConfig.target is empty: name a target model folder or hub repo id")
        if self.kv_block_size <= 0 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size={self.kv_block_size} must be a positive power of two")
        if self.max_num_seqs <= 0 or self.max_prefill_tokens <= 0:
            raise ValueError("max_num_seqs and max_prefill_tokens must be positive")
        if self.target_impl not in TARGET_IMPLS:
            raise ValueError(f"target_impl={self.target_impl!r}: choose one of {', '.join(TARGET_IMPLS)}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
        for key in ("target_revision", "drafter_revision"):
            revision = getattr(self, key)
            if revision is not None and (not isinstance(revision, str) or not revision
                                         or any(c.isspace() for c in revision)):
                raise ValueError(f"{key}={revision!r} must be a hub commit sha, tag or branch name, as a string "
                                 "(quote a sha of digits in YAML), or null for the repo's default branch")
        if self.drafter_revision is not None and not self.drafter:
            raise ValueError(f"drafter_revision={self.drafter_revision!r} is set without a drafter: "
                             "set engine.drafter, or remove drafter_revision")


TOPOLOGIES = ("split", "colocated")
# ServeConfig keys only the routers read. A running application takes a change of these in place
# (Serve's user_config: the routers' reconfigure); any other change rebuilds it and reloads the models.
ROUTER_SETTINGS = ("max_pending", "default_max_tokens")


@dataclass(frozen=True)
class ServeConfig:
    """The served application: the engine plus deployment shape. `dflash serve --config FILE`
    reads it from YAML, and the Helm chart renders the same YAML into serveConfigV2."""

    engine: EngineConfig
    # split: verifier and drafter are separate actors (the product's shape); colocated: one process.
    topology: str = "split"
    num_replicas: int = 1
    # Above num_replicas: Serve autoscales the verifier between the two, adding a replica while
    # the replicas average more ongoing requests than engine.max_num_seqs (a full batch). 0: fixed.
    max_replicas: int = 0
    # Router (gRPC ingress) replicas, and as above, their autoscaling bound (target: max_pending / 2).
    router_replicas: int = 1
    router_max_replicas: int = 0
    grpc_port: int = 9000
    # Serve's HTTP port: the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models).
    http_port: int = 8000
    metrics_port: int = 8080
    # The model name the OpenAI API serves and expects in `model`; empty: the target's folder name
    # for a local folder, else the target as given (a hub id).
    served_model_name: str = ""
    # A file of API keys, one a line (the chart mounts a Secret); empty: no authentication. Every
    # gRPC call and HTTP request but the health checks must then present one.
    api_keys_file: str = ""
    # Requests in flight per router replica (each has its own count) before RESOURCE_EXHAUSTED.
    max_pending: int = 256
    default_max_tokens: int = 256
    # GPUs per verifier replica when engine.device is cuda (none on CPU). Its drafter runs on the
    # same GPU: features reach it by CUDA IPC, which needs one device seen by both processes.
    verifier_num_gpus: float = 1.0

    @property
    def gpus_per_verifier(self) -> float:
        return self.verifier_num_gpus if self.engine.device.startswith("cuda") else 0.0

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.engine.target)) if os.path.isdir(self.engine.target) \
            else self.engine.target

    def validate(self) -> None:
        self.engine.validate()
        if self.engine.device.startswith("cuda") and self.verifier_num_gpus <= 0:
            raise ValueError(f"engine.device={self.engine.device} needs verifier_num_gpus > 0")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology={self.topology!r}: choose one of {', '.join(TOPOLOGIES)}")
        if self.topology == "split" and not self.engine.drafter:
            raise ValueError("topology=split needs engine.drafter (or use topology=colocated for target-only)")
        if min(self.num_replicas, self.router_replicas, self.max_pending, self.default_max_tokens) < 1:
            raise ValueError("num_replicas, router_replicas, max_pending and default_max_tokens must be positive")
        for low, high in (("num_replicas", "max_replicas"), ("router_replicas", "router_max_replicas")):
            if getattr(self, high) and getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high}={getattr(self, high)} is below {low}={getattr(self, low)}: "
                                 f"set it to at least {low} to autoscale, or 0 for a fixed count")

    @classmethod
    def from_dict(cls, raw: dict) -> ServeConfig:
        """Strict: an unknown key is an error naming it and the known ones (a typo must not be
        silently ignored, as Ray's own schema does)."""
        raw = dict(raw or {})
        engine_raw = raw.pop("engine", None) or {}
        _check_keys(raw, cls, "", skip={"engine"})
        _check_keys(engine_raw, EngineConfig, "engine.")
        config = cls(engine=EngineConfig(**engine_raw), **raw)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str) -> ServeConfig:
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f)
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        try:
            return cls.from_dict(raw or {})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def router_settings(self) -> dict:
        return {key: getattr(self, key) for key in ROUTER_SETTINGS}

    def with_router_settings(self, settings: dict) -> ServeConfig:
        """This config with `settings` (a Router's user_config, any subset of ROUTER_SETTINGS)
        over it, checked as strictly as a whole config."""
        unknown = sorted(set(settings or {}) - set(ROUTER_SETTINGS))
        if unknown:
            raise ValueError(f"Router user_config: unknown key(s) {', '.join(unknown)}; "
                             f"only {', '.join(ROUTER_SETTINGS)} apply in place")
        for key, value in (settings or {}).items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Router user_config: {key} must be an integer, got {value!r}")
        config = dataclasses.replace(self, **(settings or {}))
        config.validate()
        return config


def _check_keys(raw: dict, kind: type, prefix: str, skip: set[str] = frozenset()) -> None:
    known = {f.name for f in dataclasses.fields(kind)} - set(skip)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
                         f"known: {', '.join(prefix + k for k in sorted(known))}")
