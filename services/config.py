"""The one typed configuration of dflash-serve.

Every knob lives here once, as a pydantic field with its default and description. The models are
frozen and strict (a key they do not know, a string where a number goes, or a value out of range
is refused at construction with a message naming the key), and everything else derives from them:
the Helm chart's values schema (tests/helm/config_schema.py), the CLI's flags (services/cli/flags.py),
and the DFLASH_* environment overrides read by `load`.

Where values come from, highest first: command-line flags > DFLASH_* environment variables > the
YAML file (or serveConfigV2's args) > the defaults below. Only `load` reads the environment:
constructing a config, or `from_dict` (what the deployments do with the config they are given),
never does, so a test or a replica sees exactly the values it was handed.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

TargetImpl = Literal["auto", "fused", "transformers"]
Topology = Literal["split", "colocated"]
Speculation = Literal["adaptive", "fixed"]
DrafterPlacement = Literal["shared", "own_gpu"]
Ingress = Literal["router", "serve"]
TARGET_IMPLS = typing.get_args(TargetImpl)
TOPOLOGIES = typing.get_args(Topology)
SPECULATION_MODES = typing.get_args(Speculation)
# DFLASH_TOPOLOGY=colocated, DFLASH_ENGINE__MAX_NUM_SEQS=64: the prefix, then the key path joined by __.
ENV_PREFIX = "DFLASH_"
ENV_NESTED_DELIMITER = "__"


# False while a config is being validated: a nested one (the engine inside a ServeConfig) then
# leaves its errors to the outer one, which names them with their prefix.
_OUTERMOST = contextvars.ContextVar("dflash_config_outermost", default=True)


@contextlib.contextmanager
def _plain_errors(model: type[BaseModel]):
    """Turns the outermost config's ValidationError into a ValueError in plain words."""
    if not _OUTERMOST.get():
        yield
        return
    token = _OUTERMOST.set(False)
    try:
        yield
    except ValidationError as err:
        raise ValueError(explain(err, model)) from None
    finally:
        _OUTERMOST.reset(token)


class _Config(BaseModel):
    """Frozen, strict, unknown keys refused; a bad value raises ValueError in plain words
    (`explain`), not pydantic's dump."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def __init__(self, **values):
        with _plain_errors(type(self)):
            super().__init__(**values)

    @classmethod
    def from_dict(cls, raw: dict | None):
        """Strict: an unknown key is an error naming it and the known ones (a typo must not be
        silently ignored, as Ray's own schema does)."""
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"expected a mapping of config keys, got {type(raw).__name__}")
        with _plain_errors(cls):
            return cls.model_validate(raw or {})

    def to_dict(self) -> dict:
        return self.model_dump()


class EngineConfig(_Config):
    """The speculative engine: models, KV cache and scheduler limits."""

    target: str = Field("", validate_default=True, description="The target model: a folder or a hub repo id.")
    drafter: str | None = Field(None, description="The DFlash drafter: a folder or a hub repo id; null: target-only "
                                "(autoregressive) decoding, the baseline every speedup is measured against.")
    device: str = Field("cpu", description="Where the models run: cpu, cuda or cuda:N.")
    dtype: str = Field("auto", description="auto: the checkpoint's own dtype on GPU, float32 on CPU (bf16 matmuls "
                       "are slow there); or bfloat16, float16, float32.")
    kv_block_size: int = Field(16, description="Tokens per KV block, shared by the target and drafter pools (one "
                               "block table per sequence); a power of two.")
    num_kv_blocks: int = Field(0, ge=0, description="KV blocks per pool; 0: what max_num_seqs sequences of "
                               "max_model_len tokens can hold, within kv_memory_fraction of free GPU memory (512 on "
                               "CPU). More keeps more finished prompts in the prefix cache, and costs start-up time.")
    kv_memory_fraction: float = Field(0.85, gt=0, le=1, description="The most of free GPU memory the KV pools take "
                                      "when num_kv_blocks is 0.")
    max_num_seqs: int = Field(32, gt=0, description="Sequences decoded together: the running batch.")
    max_prefill_tokens: int = Field(2048, gt=0, description="Prompt tokens per step; longer prompts are prefilled "
                                    "in chunks so running requests keep going.")
    max_model_len: int = Field(0, ge=0, description="Prompt plus output tokens per sequence; 0: the target's "
                               "max_position_embeddings.")
    max_tokens_limit: int = Field(32768, gt=0, description="The most tokens a request may ask for.")
    cuda_graphs: bool = Field(True, description="Capture CUDA graphs for the fixed-shape decode, verify and draft "
                              "forwards (GPU only).")
    prefill_graph_tokens: int = Field(2048, ge=0, description="A step's prefill of at most this many prompt "
                                      "tokens (and at most 8 prompts) replays a CUDA graph captured at start-up "
                                      "for its size (powers of two from 16) instead of launching every kernel "
                                      "from Python; 0: prefill always eagerly (GPU only).")
    target_impl: TargetImpl = Field("auto", description="The target's forward: fused (our layer code and kernels: "
                                    "Llama, Qwen2, Qwen3 dense), transformers (its own layer code, any causal LM), "
                                    "or auto (fused where it applies).")
    deterministic: bool = Field(False, description="Batch-invariant target forwards: each token's logits have the "
                                "same bits whatever else the GPU computes beside it (other sequences, decode, verify or "
                                "prefill), so greedy output equals target-only decoding bit for bit in bf16 and fp16 "
                                "too, and a seeded request's output does not depend on the batch. Needs the fused "
                                "target forward; slower (26–53 % fewer tokens/s on an H200 at Qwen3-8B shapes for now).")
    tensor_parallel_size: int = Field(1, gt=0, description="Devices the target is sharded over, one process each "
                                      "(Megatron-style: attention and KV heads, MLP rows and the vocabulary split, "
                                      "one all-reduce after each attention and MLP; NCCL on GPUs, gloo on CPU); the "
                                      "scheduler and the drafter run on the first. Needs the fused target forward and "
                                      "head counts it divides; not with deterministic. GPUs: the ones after "
                                      "engine.device's (cuda: 0 to N-1). 1: no sharding.")
    async_scheduling: bool = Field(True, description="Launch each round before the host has read the last one's "
                                   "results, so sampling, stop checks and streaming overlap the GPU's work (with "
                                   "CUDA graphs and an in-process drafter, or none). Off: one host sync between "
                                   "rounds.")
    enable_prefix_caching: bool = Field(True, description="Keep full KV blocks of committed tokens (the target's and "
                                        "the drafter's) keyed by content, shared between requests and kept after "
                                        "they finish until evicted: a prompt that starts like an earlier one (a "
                                        "system prompt, the conversation so far) skips prefilling that part.")
    target_revision: str | None = Field(None, description="The hub revision (commit sha, tag or branch) of a target "
                                        "given as a hub repo id; null: the repo's default branch. Refused for a "
                                        "folder, which has no revisions.")
    drafter_revision: str | None = Field(None, description="The hub revision of a drafter given as a hub repo id "
                                         "(published drafters are retrained in place under the same id: pin it).")
    speculation: Speculation = Field("adaptive", description="How many of the drafter's B-1 drafts a round verifies "
                                     "(it still drafts them all; 0 = a plain AR step). adaptive: per round, the k that "
                                     "maximises the batch's expected tokens per second, from verify/draft costs "
                                     "measured at start-up and acceptance measured online; fixed: always B-1.")
    num_speculative_tokens_per_batch_size: dict[int, int] = Field(
        default_factory=dict, description="Batch size -> k, overriding `speculation` (like vLLM's "
        "num_speculative_tokens per batch size): a batch of n runs the k of the largest key <= n; below the smallest "
        "key, the policy. E.g. {1: 15, 8: 7, 32: 0}. Each value is also captured as a CUDA graph bucket.")
    round_costs_dir: str | None = Field(
        None, description="Where the round costs measured at start-up are kept for later starts and other replicas "
        "(one file per model shapes, settings and machine; on Kubernetes a volume the replicas share); null: "
        "round-costs/ in the model cache ($DFLASH_CACHE); empty: measure them at every start (a served replica serves "
        "target-only meanwhile and attaches the drafter once they are timed).")
    synthetic_acceptance_length: float | None = Field(
        None, ge=1, description="BENCHMARKS ONLY, outputs are then NOT the target's: every round that verifies drafts "
        "accepts as many as keep the mean acceptance length (tau) at this value, whatever the drafter proposed, to time "
        "a random-weight pair at a realistic acceptance. null: off (always, in service).")

    @field_validator("target")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value:
            raise ValueError("empty: name a target model folder or hub repo id")
        return value

    @field_validator("target_revision", "drafter_revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError("must be a hub commit sha, tag or branch name, with no spaces")
        return value

    @model_validator(mode="after")
    def _pinned_drafter(self) -> EngineConfig:
        if self.drafter_revision is not None and not self.drafter:
            raise ValueError(f"drafter_revision={self.drafter_revision!r} is set without a drafter: set "
                             "engine.drafter, or remove drafter_revision")
        return self

    @model_validator(mode="after")
    def _deterministic_forward(self) -> EngineConfig:
        if self.deterministic and self.target_impl == "transformers":
            raise ValueError("deterministic=true needs the fused target forward (its kernels are the batch-invariant "
                             "ones): set target_impl to auto or fused")
        return self

    @model_validator(mode="after")
    def _sharded_forward(self) -> EngineConfig:
        if self.tensor_parallel_size > 1 and self.target_impl == "transformers":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} shards the fused target forward: set "
                             "target_impl to auto or fused (or tensor_parallel_size to 1)")
        if self.tensor_parallel_size > 1 and self.deterministic:
            # An all-reduce's summation order (ring or tree, chunking) depends on the message size,
            # i.e. on the batch: a row's bits would depend on what runs beside it.
            raise ValueError(f"deterministic=true with tensor_parallel_size={self.tensor_parallel_size}: the "
                             "all-reduce's summation order depends on the batch size, so no row is batch-invariant; "
                             "use one of the two")
        return self

    @field_validator("num_speculative_tokens_per_batch_size", mode="before")
    @classmethod
    def _batch_sizes(cls, value):
        """Batch size >= 1 -> draft tokens >= 0; keys may come as strings (YAML through Helm)."""
        if not isinstance(value, dict):
            return value  # pydantic names the type error
        table = {}
        for n, k in value.items():
            if not str(n).isdigit() or int(n) < 1 or not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise ValueError(f"{n!r}: {k!r} must map a batch size >= 1 to a number of draft tokens >= 0 "
                                 "(k above the drafter's B-1 is capped at B-1)")
            table[int(n)] = k
        return table

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value <= 0 or value & (value - 1):
            raise ValueError("must be a positive power of two")
        return value

    @classmethod
    def load(cls, flags: dict | None = None, defaults: dict | None = None) -> EngineConfig:
        """The engine of `dflash generate` / `bench`: `flags` > DFLASH_ENGINE__* > `defaults`."""
        return cls.from_dict(_layered(defaults, environment().get("engine", {}), flags))


# ServeConfig keys only the routers read. A running application takes a change of these in place
# (Serve's user_config: the routers' reconfigure); any other change rebuilds it and reloads the models.
ROUTER_SETTINGS = ("max_pending", "default_max_tokens", "stream_messages_per_s")


class ServeConfig(_Config):
    """The served application: the engine plus deployment shape. `dflash serve --config FILE`
    reads it from YAML, and the Helm chart renders the same YAML into serveConfigV2."""

    engine: EngineConfig = Field(description="The speculative engine: models, KV cache and scheduler limits.")
    topology: Topology = Field("split", description="split: verifier and drafter are separate actors (the "
                               "product's shape); colocated: one process.")
    num_replicas: int = Field(1, gt=0, description="Verifier replicas.")
    max_replicas: int = Field(0, ge=0, description="Above num_replicas: Serve autoscales the verifier between the "
                              "two, adding a replica while the replicas average more ongoing requests than "
                              "engine.max_num_seqs (a full batch). 0: a fixed count.")
    router_replicas: int = Field(1, gt=0, description="Router (gRPC and HTTP ingress) replicas.")
    router_max_replicas: int = Field(0, ge=0, description="Above router_replicas: Serve autoscales the routers "
                                     "between the two (target: max_pending / 2 ongoing requests). 0: a fixed count.")
    grpc_port: int = Field(9000, ge=1, le=65535, description="The gRPC API's port (dflash.v1.Generation), on every "
                           "interface.")
    http_port: int = Field(8000, ge=1, le=65535, description="The HTTP port: the OpenAI-compatible API "
                           "(/v1/chat/completions, /v1/completions, /v1/models).")
    http_host: str = Field("127.0.0.1", description="The HTTP API's interface (0.0.0.0: every one).")
    ingress: Ingress = Field("router", description="Who serves grpc_port and http_port. router: each router "
                             "replica itself (every replica of a node on the same ports, SO_REUSEPORT), and Ray "
                             "Serve runs no proxy: a first token ~4 ms sooner, and the OpenAI API streams at the "
                             "engine's pace (BENCHMARKS, the serving path). serve: Ray Serve's proxies, which call "
                             "the routers; KubeRay's RayService routes its serve Service to them (the chart's "
                             "choice).")
    metrics_port: int = Field(8080, ge=1, le=65535, description="Prometheus metrics (/metrics) of each Ray node.")
    served_model_name: str = Field("", description="The model name the OpenAI API serves and expects in `model`; "
                                   "empty: the target's folder name for a local folder, else the target as given "
                                   "(a hub id).")
    api_keys_file: str = Field("", description="A file of API keys, one a line (the chart mounts a Secret); empty: "
                               "no authentication. Every gRPC call and HTTP request but the health checks must then "
                               "present one.")
    max_pending: int = Field(256, gt=0, description="Requests in flight per router replica (each has its own count) "
                             "before RESOURCE_EXHAUSTED.")
    default_max_tokens: int = Field(256, gt=0, description="Tokens generated for a request that does not say.")
    stream_messages_per_s: float = Field(1000.0, ge=0, description="Streamed messages per second a router replica "
                                         "aims to send over all its requests: after each message a request waits "
                                         "(its requests in flight / this) seconds and sends everything that arrived "
                                         "meanwhile as one. Ray Serve's proxy forwards each message on its own, and "
                                         "past a few thousand a second it falls behind the engine (BENCHMARKS, "
                                         "'The serving path'). The first and the last message go at once. 0: no "
                                         "wait (one message per engine step and request).")
    verifier_num_gpus: float = Field(1.0, ge=0, description="GPUs per verifier replica when engine.device is cuda "
                                     "(none on CPU). With drafter_placement shared its drafter runs on the same GPU. "
                                     "With engine.tensor_parallel_size N > 1: per rank, and 1 (a whole GPU each): "
                                     "the replica takes N GPUs of one node, its ranks processes on them.")
    drafter_placement: DrafterPlacement = Field("shared", description="Where a split verifier's drafter computes. "
                                                "shared: on the verifier's GPU. own_gpu: on a GPU of its own, one "
                                                "more per replica; it maps the verifier's buffers by CUDA IPC and "
                                                "copies each step's feature rows GPU to GPU, so both GPUs must be on "
                                                "one node (Ray places the pair with a STRICT_PACK placement group, "
                                                "and waits while no node has both free). Needs topology split, a "
                                                "drafter and engine.device cuda.")
    engine_adoption_s: float = Field(60.0, ge=0, description="How long the engine process of a verifier replica "
                                     "that died waits, serving the requests it holds, for the next replica on the "
                                     "same node and GPU to adopt it: that replica then serves in seconds, with the "
                                     "models, KV cache and graphs already there (the same code and configuration "
                                     "only; another makes it exit first). Its GPU memory stays taken meanwhile. 0: "
                                     "it dies with its replica.")

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        if self.engine.device.startswith("cuda") and self.verifier_num_gpus <= 0:
            raise ValueError(f"engine.device={self.engine.device} needs verifier_num_gpus > 0")
        world = self.engine.tensor_parallel_size
        if world > 1 and self.engine.device.startswith("cuda") and self.verifier_num_gpus != 1:
            raise ValueError(f"engine.tensor_parallel_size={world} runs each rank on a whole GPU of its own: set "
                             f"verifier_num_gpus to 1 (GPUs per rank; the replica takes {world}), not "
                             f"{self.verifier_num_gpus}")
        if self.topology == "split" and not self.engine.drafter:
            raise ValueError("topology=split needs engine.drafter (or use topology=colocated for target-only)")
        if self.drafter_placement == "own_gpu":
            needs = [(self.topology == "split", f"topology=split (not {self.topology}: a colocated engine has no "
                      "drafter actor to place)"),
                     (bool(self.engine.drafter), "engine.drafter (target-only decoding has no drafter)"),
                     (self.engine.device.startswith("cuda"), f"engine.device=cuda (not {self.engine.device})")]
            missing = [need for met, need in needs if not met]
            if missing:
                raise ValueError(f"drafter_placement=own_gpu needs {' and '.join(missing)}; or use "
                                 "drafter_placement=shared")
        for low, high in (("num_replicas", "max_replicas"), ("router_replicas", "router_max_replicas")):
            if getattr(self, high) and getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high}={getattr(self, high)} is below {low}={getattr(self, low)}: "
                                 f"set it to at least {low} to autoscale, or 0 for a fixed count")
        return self

    @property
    def gpus_per_verifier(self) -> float:
        """GPUs Ray gives a verifier replica: one per tensor-parallel rank (all in the replica's
        own bundle: one node, and the ranks, its processes, see them all)."""
        return self.verifier_num_gpus * self.engine.tensor_parallel_size if self.engine.device.startswith("cuda") \
            else 0.0

    @property
    def gpus_per_drafter(self) -> float:
        """GPUs Ray gives a split verifier's drafter actor: a whole one with own_gpu (validation
        ensured CUDA), else none (it computes on its verifier's)."""
        return 1.0 if self.drafter_placement == "own_gpu" else 0.0

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.engine.target)) if os.path.isdir(self.engine.target) \
            else self.engine.target

    @classmethod
    def load(cls, raw: dict | None = None, flags: dict | None = None, defaults: dict | None = None) -> ServeConfig:
        """The loading path of `dflash serve` and serveConfigV2: `flags` > DFLASH_* environment >
        `raw` (a YAML file's mapping, or the application's args) > `defaults` > the fields' own.
        Nested keys merge: DFLASH_ENGINE__MAX_NUM_SEQS replaces engine.max_num_seqs only."""
        if raw is not None and not isinstance(raw, dict):
            raise ValueError("expected a mapping at the top level")
        return cls.from_dict(_layered(defaults, raw, environment(), flags))

    @classmethod
    def from_yaml(cls, path: str, flags: dict | None = None, defaults: dict | None = None) -> ServeConfig:
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f)
        try:
            return cls.load(raw, flags, defaults)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

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
            number = type(getattr(self, key)) is float  # else an integer setting
            if not isinstance(value, (int, float) if number else int) or isinstance(value, bool):
                raise ValueError(f"Router user_config: {key} must be {'a number' if number else 'an integer'}, "
                                 f"got {value!r}")
        return ServeConfig(**{**dict(self), **(settings or {})})


def environment() -> dict:
    """The DFLASH_* variables that name config keys, in ServeConfig's shape. pydantic-settings
    finds them (case-insensitive, `__` descends into engine) and parses what it can ("64" -> 64,
    "false" -> False, "null" -> None); the strict models then refuse what it could not."""
    from pydantic_settings import EnvSettingsSource

    return EnvSettingsSource(ServeConfig, env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER,
                             case_sensitive=False, env_parse_none_str="null")()


def _layered(*layers: dict | None) -> dict:
    """The layers merged, later ones over earlier ones, mappings key by key (None: no layer)."""
    merged: dict = {}
    for layer in layers:
        for key, value in (layer or {}).items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                value = _layered(merged[key], value)
            merged[key] = value
    return merged


def explain(err: ValidationError, model: type[BaseModel]) -> str:
    """A ValidationError in plain words: each bad key (with its engine. prefix), its value and
    what is wrong with it; unknown keys with the known ones beside them."""
    unknown, problems = [], []
    for error in err.errors():
        key = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.append(key)
        elif not key:  # a check across fields (a model validator): its message says it all
            problems.append(_reason(error, None))
        elif error["type"] == "missing":
            problems.append(f"{key} is missing: {_field(model, error['loc']).description}")
        else:
            problems.append(f"{key}={error['input']!r}: {_reason(error, _field(model, error['loc']))}")
    for parent in sorted({key.rpartition(".")[0] for key in unknown}, reverse=True):
        prefix = parent + "." if parent else ""
        known = sorted(_model_at(model, tuple(parent.split(".")) if parent else ()).model_fields)
        problems.insert(0, f"unknown config key(s) {', '.join(k for k in unknown if k.rpartition('.')[0] == parent)}"
                           f"; known: {', '.join(prefix + name for name in known)}")
    return "; ".join(problems)


def _reason(error: dict, field) -> str:
    context = error.get("ctx", {})
    if error["type"] == "literal_error":
        return "choose one of " + ", ".join(map(str, typing.get_args(field.annotation)))
    if (error["type"], context) in (("greater_than", {"gt": 0}), ("greater_than_equal", {"ge": 1})):
        return "must be positive"
    message = error["msg"].removeprefix("Value error, ")
    return message.replace("Input should be", "must be").replace("String should", "must")


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel]:
    for name in path:
        model = model.model_fields[name].annotation
    return model


def _field(model: type[BaseModel], loc: tuple):
    return _model_at(model, loc[:-1]).model_fields[loc[-1]]
