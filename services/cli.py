"""`dflash` command line."""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import os
import signal
import sys
import threading
import time
import types
import typing

import torch
from pydantic import BaseModel

from dflash_serve.services.config import EngineConfig, ServeConfig, environment

# Flags that predate the generated ones: both spellings stay.
ALIASES = {"cuda_graphs": ("--eager", "no CUDA graphs: the same as --no-cuda-graphs"),
           "async_scheduling": ("--sync-rounds", "wait for each round's results before launching the next: the "
                                                 "same as --no-async-scheduling")}


def _auto_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _drafter_flag(value: str) -> str | None:
    """`--drafter none`: target-only, the config's null."""
    from dflash_serve.services.models.default_pair import NO_DRAFTER

    return None if value == NO_DRAFTER else value


def _mapping_flag(value: str) -> dict:
    """A mapping flag, written as in the help: `{1: 15, 8: 7, 32: 0}` (or JSON); the config
    validates its keys and values."""
    try:
        mapping = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        mapping = None
    if not isinstance(mapping, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping such as {{1: 15, 8: 7, 32: 0}}, got {value!r}")
    return mapping


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str,
                     helps: dict[str, str] | None = None, defaults: dict[str, str] | None = None) -> None:
    """A flag for every field of `model` (`max_num_seqs` -> `--max-num-seqs`; booleans also as
    `--no-...`), its help the field's description and default. A flag left out sets nothing
    (argparse.SUPPRESS), so the environment, the config file and the defaults below it apply:
    `given_config_flags` reads back the ones given. `helps` replaces a field's description,
    `defaults` names a default the command picks itself (`helps` say their own)."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue  # ServeConfig.engine: its fields get their own group
        shown = (defaults or {}).get(name, repr(field.get_default(call_default_factory=True)))
        help_text = (helps or {}).get(name) or f"{field.description} (default: {shown})"
        options = dict(dest=name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        kinds = [kind for kind in typing.get_args(field.annotation) if kind is not type(None)] \
            if isinstance(field.annotation, types.UnionType) else [field.annotation]
        if kinds == [bool]:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kinds[0]) is typing.Literal:
            options["choices"] = typing.get_args(kinds[0])
        elif name == "drafter":
            options["type"] = _drafter_flag
        elif typing.get_origin(kinds[0]) is dict:
            options["type"] = _mapping_flag
        else:
            options["type"] = kinds[0]
        group.add_argument("--" + name.replace("_", "-"), **options)
        if name in ALIASES:
            flag, help_text = ALIASES[name]
            group.add_argument(flag, dest=name, action="store_const", const=False, default=argparse.SUPPRESS,
                               help=help_text)


def given_config_flags(args: argparse.Namespace, model: type[BaseModel]) -> dict:
    """The fields of `model` given on the command line (those left out are absent)."""
    return {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}


def _model_pair(flags: dict) -> dict:
    """target and drafter as given by the flags or, under them, DFLASH_ENGINE__TARGET/DRAFTER,
    with the default pair filling in as resolve_pair does (neither given: the default pair)."""
    from dflash_serve.services.models.default_pair import NO_DRAFTER, resolve_pair

    given = {**environment().get("engine", {}), **flags}
    drafter = NO_DRAFTER if "drafter" in given and given["drafter"] is None else given.get("drafter")
    target, drafter = resolve_pair(given.get("target"), drafter)
    return {"target": target, "drafter": drafter}


def _inspect(args: argparse.Namespace) -> int:
    from dflash_serve.services.models import CheckpointError, TargetLoadError, TargetModel, load_drafter

    try:
        drafter = load_drafter(args.drafter, revision=args.revision)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = drafter.config
    params = sum(p.numel() for p in drafter.parameters())
    kinds = ", ".join(
        f"{i}:{'swa' if cfg.layer_window(i) else 'full'}/{'causal' if cfg.layer_is_causal(i) else 'bidir'}"
        for i in range(cfg.num_hidden_layers)
    )
    print(f"drafter          {args.drafter}")
    print(f"parameters       {params / 1e6:.1f} M ({cfg.dtype})")
    print(f"block size       {cfg.block_size} (drafts {cfg.block_size - 1} tokens per round)")
    print(f"mask token id    {cfg.mask_token_id}")
    print(f"target layers    {list(cfg.target_layer_ids)} (F={cfg.num_features})")
    print(f"hidden size      {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}")
    print(f"layers           {kinds}" + (f" (window {cfg.sliding_window})" if cfg.sliding_window else ""))
    print(f"rope             {cfg.rope.rope_type}, theta {cfg.rope.theta:g}")
    if args.target:
        try:
            target = TargetModel.from_pretrained(args.target, cfg.target_layer_ids, dtype=torch.float32,
                                                 revision=args.target_revision)
            drafter.check_target(target)
        except (TargetLoadError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"target           {args.target}: {target.num_layers} layers, {target.embedding_rows} embedding rows - compatible")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from dflash_serve.services.engine.loader import build_engine
    from dflash_serve.services.engine.sampling import SamplingParams
    from dflash_serve.services.models import CheckpointError, TargetLoadError
    from dflash_serve.services.models.default_pair import DefaultPairError

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    try:
        flags = given_config_flags(args, EngineConfig)
        config = EngineConfig.load(flags, defaults={"device": _auto_device(), **_model_pair(flags)})
        params.validate(max_tokens_limit=config.max_tokens_limit)
        engine = build_engine(config)
    except (CheckpointError, TargetLoadError, ValueError, DefaultPairError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if tok is None:
        print("error: the target has no tokenizer; dflash generate needs one to read --prompt", file=sys.stderr)
        return 2
    if tok.chat_template and not args.raw:
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt_ids = tok.encode(args.prompt)
    last = None
    for out in engine.stream(list(prompt_ids), params):
        print(out.new_text, end="", flush=True)
        last = out
    print()
    if last.error:
        print(f"error: {last.error}", file=sys.stderr)
        return 1
    stats = last.stats
    print(f"-- {last.num_output_tokens} tokens, finish: {last.finish_reason.value}", file=sys.stderr)
    if config.drafter:
        accepted = ", ".join(f"{c / stats.rounds:.2f}" for c in stats.accepted_per_position) if stats.rounds else "-"
        print(f"-- tau (mean accepted length incl. bonus) {stats.mean_acceptance_length:.2f} over {stats.rounds} rounds",
              file=sys.stderr)
        print(f"-- acceptance per draft position: {accepted}", file=sys.stderr)
    return 0


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    """Flags > DFLASH_* environment > the --config file > defaults. Without a file, the command's
    own defaults: the default pair, the GPU when there is one, split with a drafter."""
    flags = {**given_config_flags(args, ServeConfig), "engine": given_config_flags(args, EngineConfig)}
    if args.config:
        return ServeConfig.from_yaml(args.config, flags)
    pair = _model_pair(flags["engine"])
    defaults = {"engine": {"device": _auto_device(), **pair}, "topology": "split" if pair["drafter"] else "colocated"}
    return ServeConfig.load(flags=flags, defaults=defaults)


def _local_gpus(config: ServeConfig) -> int:
    """The GPUs `dflash serve` lends Ray on this machine: one verifier replica's, with its
    drafter's own (drafter_placement own_gpu)."""
    wanted = math.ceil(config.gpus_per_verifier + config.gpus_per_drafter)
    have = torch.cuda.device_count() if wanted else 0
    if wanted > have:
        own = " plus 1 for its drafter (drafter_placement=own_gpu)" if config.gpus_per_drafter else ""
        raise ValueError(f"a verifier replica takes {wanted} GPUs (verifier_num_gpus={config.verifier_num_gpus}{own}), "
                         f"but this machine has {have}")
    return wanted


def _serve(args: argparse.Namespace) -> int:
    from dflash_serve.services.models.default_pair import DefaultPairError

    try:
        config = _serve_config(args)
        num_gpus = _local_gpus(config)
    except (ValueError, TypeError, DefaultPairError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.cuda_mps and not config.engine.device.startswith("cuda"):
        print(f"error: --cuda-mps is for a GPU server; engine.device is {config.engine.device}", file=sys.stderr)
        return 2
    from dflash_serve.services.cuda_mps import CudaMpsError, cuda_mps

    try:
        with cuda_mps() if args.cuda_mps else contextlib.nullcontext():
            return _serve_on_ray(args, config, num_gpus)
    except CudaMpsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _serve_on_ray(args: argparse.Namespace, config: ServeConfig, num_gpus: int) -> int:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from dflash_serve.services.app import GRPC_SERVICER_FUNCTIONS, SERVE_ENV, build_app

    started = time.time()
    for name, value in SERVE_ENV.items():  # the Ray it starts inherits them; one set explicitly wins
        os.environ.setdefault(name, value)
    ray.init(include_dashboard=False, num_gpus=num_gpus or None, _metrics_export_port=config.metrics_port)
    serve.start(http_options=HTTPOptions(host=args.http_host, port=config.http_port),
                grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    serve.run(build_app(config), name="dflash", route_prefix="/")
    print(f"dflash-serve is up: the OpenAI API on http://{args.http_host}:{config.http_port}/v1 (model "
          f"{config.model_name!r}), gRPC on port {config.grpc_port} of every interface (dflash.v1.Generation; Ray "
          f"Serve's gRPC proxy has no host option), metrics on port {config.metrics_port} (/metrics)"
          + (", API keys required" if config.api_keys_file else "") + ". Try: dflash client --prompt 'Hello'",
          flush=True)
    run_until_stopped()
    print("dflash-serve: stopping (Ctrl-C again to force)", flush=True)
    try:
        serve.shutdown()  # replicas finish their requests (Serve's graceful shutdown), then go
    finally:
        ray.shutdown()
        _remove_leftovers(started)
    return 0


def _remove_leftovers(started: float) -> None:
    """What CUDA IPC left in /dev/shm for this server's exited processes (`transport.leftovers`)."""
    from dflash_serve.services.transport.leftovers import remove_cuda_ipc_leftovers

    removed, running = remove_cuda_ipc_leftovers(started)
    if removed:
        print(f"dflash-serve: removed {len(removed)} files CUDA IPC left in /dev/shm", flush=True)
    if running:
        print(f"dflash-serve: {len(running)} files in /dev/shm belong to processes still running, left in place: "
              f"{', '.join(running)}", file=sys.stderr, flush=True)


def run_until_stopped() -> None:
    """Block until SIGINT (Ctrl-C) or SIGTERM (Kubernetes, systemd, `kill`), then restore the
    handlers, so that a second signal during shutdown forces it."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):  # a timeout, so the main thread runs the handlers promptly
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _client(args: argparse.Namespace) -> int:
    import grpc

    from dflash_serve.services.client import stream_completion

    sampling = {k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens),
                                   ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed)) if v is not None}
    request = {"chat": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    api_key = args.api_key or os.environ.get("DFLASH_API_KEY")
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    last = None
    try:
        for response in stream_completion(args.address, sampling=sampling, timeout=args.timeout, metadata=metadata,
                                          **request):
            print(response.text, end="", flush=True)
            last = response
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print()
    if last is not None and last.HasField("spec_stats"):
        stats = last.spec_stats
        print(f"-- {last.usage.completion_tokens} tokens; tau {stats.mean_acceptance_length:.2f} over "
              f"{stats.num_drafts} rounds", file=sys.stderr)
    return 0


def _fetch_default(args: argparse.Namespace) -> int:
    from dflash_serve.services.models.default_pair import DefaultPairError, default_drafter, fetch_default_target, target_dir

    try:
        folder = fetch_default_target(target_dir())
    except DefaultPairError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"default target   {folder}")
    try:
        print(f"default drafter  {default_drafter()}")
    except DefaultPairError as err:
        print(f"default drafter  missing: {err}")
    return 0


def _bench_loads(args: argparse.Namespace) -> list:
    from dflash_serve.services.bench.workload import Load

    def numbers(text: str, kind, flag: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None

    if args.request_rate is None:
        if args.max_concurrency is not None:
            raise ValueError("--max-concurrency bounds an open loop: give --request-rate too (or use --concurrency)")
        return [Load(concurrency=c) for c in numbers(args.concurrency or "1,8,32", int, "--concurrency")]
    if args.concurrency is not None:
        raise ValueError("--concurrency is the closed loop; with --request-rate, bound it with --max-concurrency")
    return [Load(concurrency=args.max_concurrency, request_rate=rate, seed=args.seed or 0)
            for rate in numbers(args.request_rate, float, "--request-rate")]


def _bench_prompt_sets(args: argparse.Namespace, setup: dict, tokenizer) -> dict:
    from dflash_serve.services.bench.prompts import CONVERSATION_LOADERS, load_conversations, load_prompts, random_prompts

    sets = {}
    for name in args.dataset.split(","):
        if name == "random":
            if "vocab_size" not in setup:
                raise ValueError("the random set draws token ids from the model's vocabulary: with --backend openai "
                                 "give --tokenizer (the served model's tokenizer folder or hub id)")
            decode = tokenizer.decode if tokenizer is not None else None
            sets[name] = random_prompts(args.num_prompts, args.input_len, args.output_len, setup["vocab_size"],
                                        seed=args.seed or 0, decode=decode)
        elif name in CONVERSATION_LOADERS:
            sets[name] = load_conversations(name, args.data_dir, args.num_prompts)
        else:
            sets[name] = load_prompts(name, args.data_dir, args.num_prompts)
    return sets


# `dflash bench --compare`: the engines it can build from one set of engine flags.
COMPARED_ENGINES = ("ar", "adaptive", "fixed")


def _compared_engines(args: argparse.Namespace, engine_flags: dict) -> list[str]:
    """The engines `--compare` names, checked against the other flags ([]: no comparison)."""
    if args.compare is None:
        if args.slices is not None:
            raise ValueError("--slices cuts the runs of a comparison: give --compare too, or leave --slices out")
        if args.passes != 1:
            raise ValueError("--passes repeats a comparison: give --compare too, or leave --passes out")
        return []
    names = args.compare.split(",")
    unknown = [n for n in names if n not in COMPARED_ENGINES]
    if unknown or len(set(names)) < len(names) or len(names) < 2:
        raise ValueError(f"--compare takes two or more of {', '.join(COMPARED_ENGINES)} (ar: the target alone; "
                         f"adaptive, fixed: the drafter under that --speculation), each once; got {args.compare!r}")
    if args.backend != "embedded":
        raise ValueError("--compare builds the engines in this process: use it with --backend embedded")
    if "speculation" in engine_flags:
        raise ValueError("--compare sets each engine's --speculation: leave --speculation out")
    if args.slices is not None and args.slices < 1:
        raise ValueError("--slices must be positive")
    if args.passes < 1:
        raise ValueError("--passes must be positive")
    return names


def _compared_configs(config: EngineConfig, names: list[str]) -> dict[str, EngineConfig]:
    """One engine config per compared engine; on a GPU each engine's KV pools take an equal share
    of the memory the one engine's would (engine i, sized after i others, takes f / (n - i*f) of
    what is free then)."""
    if not config.drafter and set(names) - {"ar"}:
        raise ValueError("--compare adaptive or fixed needs a drafter, and the engine has none (--drafter none?)")
    n, f = len(names), config.kv_memory_fraction
    configs = {}
    for i, name in enumerate(names):
        update = {"drafter": None, "drafter_revision": None} if name == "ar" else {"speculation": name}
        configs[name] = config.model_copy(update={**update, "kv_memory_fraction": f / (n - i * f)})
    return configs


def _key_refused(api_key: str | None, variable: str) -> str:
    given = "refused the API key given" if api_key else "requires an API key and none was given"
    return f"{given}: pass the server's key with --api-key KEY (or in ${variable})"


def _bench(args: argparse.Namespace) -> int:
    import os

    import grpc
    import httpx

    from dflash_serve.services.bench.prompts import CONVERSATION_LOADERS
    from dflash_serve.services.bench.load_generators import EmbeddedBackend, GrpcBackend, OpenAIBackend
    from dflash_serve.services.bench.serve_bench import default_slices, run_bench, run_interleaved, write_report
    from dflash_serve.services.bench.workload import BenchSampling
    from dflash_serve.services.models import CheckpointError, TargetLoadError
    from dflash_serve.services.models.default_pair import DefaultPairError

    tokenizer, base_url, api_key = None, args.base_url or "http://127.0.0.1:8000", None
    try:
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be positive")
        loads = _bench_loads(args)
        named = [name for name in args.dataset.split(",") if name != "random"]
        if named and args.data_dir is None:
            raise ValueError(f"prompt set {named[0]!r} is read from files: give --data-dir, the folder holding "
                             "them (README, 'Benchmark prompt sets', lists them and where they come from), or use "
                             "--dataset random")
        engine_flags = given_config_flags(args, EngineConfig)
        if args.backend != "embedded" and engine_flags:
            given = ", ".join("--" + name.replace("_", "-") for name in engine_flags)
            raise ValueError(f"{given}: the engine's flags go with --backend embedded; a server benchmarks the "
                             "models it serves, as it serves them")
        openai_only = [args.base_url, args.tokenizer, args.metrics_url, args.model,
                       args.endpoint != OpenAIBackend.ENDPOINTS[0]]
        if args.backend != "openai" and any(openai_only):
            raise ValueError("--base-url, --endpoint, --model, --tokenizer and --metrics-url go with --backend openai")
        conversations = [name for name in named if name in CONVERSATION_LOADERS]
        if conversations and args.backend == "openai" and args.endpoint != "/v1/chat/completions":
            raise ValueError(f"{conversations[0]!r} sends conversations, which need the server's chat template: "
                             "give --endpoint /v1/chat/completions")
        compared = _compared_engines(args, engine_flags)
        if args.backend == "embedded":
            from dflash_serve.services.engine.loader import build_engine
            from dflash_serve.services.gc_freeze import freeze_startup_objects

            most = max(load.concurrency or args.num_prompts for load in loads)
            defaults = {"device": _auto_device(), "max_num_seqs": most, **_model_pair(engine_flags)}
            config = EngineConfig.load(engine_flags, defaults=defaults)
            if compared:
                backends = {name: EmbeddedBackend(build_engine(cfg))
                            for name, cfg in _compared_configs(config, compared).items()}
                backend = backends[next(name for name in compared if name != "ar")]  # the setup names its drafter
            else:
                backend = EmbeddedBackend(build_engine(config))
            freeze_startup_objects()  # as a server's processes do: the measured steps are theirs
        elif args.backend == "openai":
            if args.tokenizer:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
            backend = OpenAIBackend(base_url, endpoint=args.endpoint, model=args.model, api_key=api_key,
                                    metrics_url=args.metrics_url, tokenizer=tokenizer, timeout=args.timeout)
        else:
            api_key = args.api_key or os.environ.get("DFLASH_API_KEY")
            backend = GrpcBackend(args.address, timeout=args.timeout, api_key=api_key)
        setup = backend.describe()
        # Token prompts go as ids everywhere but in chat messages, which need their text.
        chat = args.backend == "openai" and backend.chat
        prompt_sets = _bench_prompt_sets(args, setup, tokenizer if chat else None)
    except (ValueError, OSError, CheckpointError, TargetLoadError, DefaultPairError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            print(f"error: the server at {args.address} {_key_refused(api_key, 'DFLASH_API_KEY')}", file=sys.stderr)
        else:
            print(f"error: no dflash server answers at {args.address}: {err.code().name}: {err.details()}",
                  file=sys.stderr)
        return 2
    except httpx.HTTPError as err:
        if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in (401, 403):
            print(f"error: the server at {base_url} {_key_refused(api_key, 'OPENAI_API_KEY')} "
                  f"(HTTP {err.response.status_code})", file=sys.stderr)
        else:
            print(f"error: no OpenAI-compatible server answers at {base_url}: {err}", file=sys.stderr)
        return 2
    sampling = BenchSampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                             ignore_eos=args.ignore_eos)
    if compared:
        slices = args.slices or default_slices(len(compared))
        runs = run_interleaved(backends, prompt_sets, loads, sampling, warmup=args.warmup, slices=slices,
                               passes=args.passes)
        setup.update(engines={name: b.describe() for name, b in backends.items()}, slices=slices, passes=args.passes)
    else:
        runs = run_bench(backend, prompt_sets, loads, sampling, warmup=args.warmup)
    setup.update(datasets=list(prompt_sets), num_prompts=args.num_prompts,
                 loads=[load.describe() for load in loads],
                 warmup=args.warmup, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                 ignore_eos=args.ignore_eos)
    if "random" in prompt_sets:
        setup.update(input_len=args.input_len, output_len=args.output_len)
    paths = write_report(args.out, setup, runs)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from dflash_serve.services.models import CheckpointError, TargetLoadError
    from dflash_serve.services.training import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for name in ("prompts", "target_layer_ids"):
        if name in values:
            values[name] = tuple(int(x) if name == "target_layer_ids" else x for x in values[name].split(","))
    try:
        train(TrainConfig(**values))
    except (ValueError, CheckpointError, TargetLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


ENGINE_FLAGS_TITLE = "EngineConfig; flags > DFLASH_ENGINE__* > defaults"
MODEL_PAIR_HELP = {
    "target": "The target model: a folder or a hub repo id (omit both --target and --drafter: the default pair, "
              "SmolLM2-135M-Instruct and its drafter).",
    "drafter": "The DFlash drafter: a folder or a hub repo id; 'none': target-only (omitted: the default drafter "
               "without --target, target-only with it).",
}
COMMAND_DEFAULTS = {"device": "cuda when there is a GPU, else cpu"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash speculative decoding server")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="load a z-lab-format drafter, describe it, check it against a target")
    inspect.add_argument("drafter", help="drafter folder or hub repo id (e.g. z-lab/Qwen3-8B-DFlash-b16)")
    inspect.add_argument("--target", help="target model folder or hub repo id to check compatibility with")
    inspect.add_argument("--revision", help="hub revision of the drafter (pin it: z-lab retrains repos in place)")
    inspect.add_argument("--target-revision", help="hub revision of --target")
    inspect.set_defaults(run=_inspect)

    gen = sub.add_parser("generate", help="run the engine in-process on one prompt and print text and acceptance")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    add_config_flags(gen, EngineConfig, ENGINE_FLAGS_TITLE, helps=MODEL_PAIR_HELP, defaults=COMMAND_DEFAULTS)
    gen.set_defaults(run=_generate)

    srv = sub.add_parser("serve", help="run the gRPC service (router, verifier, drafter) on a local Ray")
    srv.add_argument("--config", help="the YAML the Helm chart renders (services/config.py:ServeConfig: engine, "
                                      "topology, ports, ...); the flags below override it, and DFLASH_* variables "
                                      "override it under them")
    srv.add_argument("--http-host", default="127.0.0.1", help="the HTTP API's interface (0.0.0.0: every one)")
    srv.add_argument("--cuda-mps", action="store_true",
                     help="run the server's processes as clients of a CUDA MPS daemon of its own, so that a verifier "
                          "and a drafter sharing its GPU share its SMs instead of time-slicing it (+4-5%% at batch 1, "
                          "BENCHMARKS.md); needs nvidia-cuda-mps-control. On Kubernetes, the device plugin runs MPS")
    serve_defaults = {"device": "cuda when there is a GPU, else cpu; with --config, 'cpu'",
                      "topology": "split with a drafter, else colocated; with --config, 'split'"}
    add_config_flags(srv, ServeConfig, "application (ServeConfig; flags > DFLASH_* > --config file > defaults)",
                     defaults=serve_defaults)
    add_config_flags(srv, EngineConfig, "engine (ServeConfig.engine; flags > DFLASH_ENGINE__* > --config file > "
                                        "defaults)", helps=MODEL_PAIR_HELP, defaults=serve_defaults)
    srv.set_defaults(run=_serve)

    cli = sub.add_parser("client", help="stream a completion from a running server")
    cli.add_argument("--address", default="127.0.0.1:9000")
    cli.add_argument("--prompt", required=True)
    cli.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    cli.add_argument("--max-tokens", type=int)
    cli.add_argument("--temperature", type=float)
    cli.add_argument("--top-p", type=float)
    cli.add_argument("--top-k", type=int)
    cli.add_argument("--seed", type=int)
    cli.add_argument("--timeout", type=float, default=300.0)
    cli.add_argument("--api-key", help="sent as `authorization: Bearer KEY` (default: $DFLASH_API_KEY)")
    cli.set_defaults(run=_client)

    fetch = sub.add_parser("fetch-default", help="obtain the default target (SmolLM2-135M-Instruct) once into "
                                                 "$DFLASH_CACHE or ~/.cache/dflash-serve")
    fetch.set_defaults(run=_fetch_default)

    bench = sub.add_parser("bench", help="load-test a server (gRPC or OpenAI HTTP) or the embedded engine: tok/s, "
                                         "TTFT, TPOT, ITL, tau and acceptance per load and prompt set; results "
                                         "also under vLLM bench's keys")
    bench.add_argument("--backend", choices=["grpc", "openai", "embedded"], default="grpc",
                       help="grpc: dflash.v1 at --address; openai: streaming /v1/completions or /v1/chat/completions "
                            "at --base-url (ours or vLLM's); embedded: the engine in this process")
    bench.add_argument("--embedded", action="store_const", dest="backend", const="embedded",
                       help="the same as --backend embedded")
    bench.add_argument("--address", default="127.0.0.1:9000", help="grpc: HOST:PORT of a dflash server")
    bench.add_argument("--api-key", help="the server's API key (default: $DFLASH_API_KEY for grpc, "
                       "$OPENAI_API_KEY for openai), sent as `Bearer KEY`")
    bench.add_argument("--base-url", help="openai: the server's URL (default http://127.0.0.1:8000)")
    bench.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                       help="openai: completions send the prompt as is, chat completions as a user message")
    bench.add_argument("--model", help="openai: the model to ask for (default: the first of /v1/models); "
                                       "the API key, if any, is read from OPENAI_API_KEY")
    bench.add_argument("--tokenizer", help="openai: the served model's tokenizer (folder or hub id), for the random "
                                           "set's vocabulary (and its text, for chat completions)")
    bench.add_argument("--metrics-url", help="openai: the server's Prometheus endpoint (ours: a Ray node's "
                                             "metrics port, http://HOST:8080/metrics; vLLM's: BASE_URL/metrics), read "
                                             "before and after each run for tau and acceptance")
    add_config_flags(bench, EngineConfig, "embedded: the engine (" + ENGINE_FLAGS_TITLE + ")", helps=MODEL_PAIR_HELP,
                     defaults={**COMMAND_DEFAULTS, "max_num_seqs": "the largest load's concurrency, or --num-prompts"})
    bench.add_argument("--dataset", default="random",
                       help="comma-separated: random (--input-len token ids drawn from the vocabulary, "
                            "--output-len tokens asked), or a set read from --data-dir: humaneval, gsm8k, math500, "
                            "mbpp, alpaca, spec-bench, spec-bench/{translation,summarization,qa,math_reasoning,rag}, "
                            "or sharegpt-2turn (conversations: turn 2, with turn 1 and its answer, is sent once the "
                            "answer arrived; --num-prompts counts conversations; latencies reported per turn)")
    bench.add_argument("--data-dir", help="the folder holding the named sets' files (README: 'Benchmark prompt "
                                          "sets' lists them and where they come from)")
    bench.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    bench.add_argument("--output-len", type=int, default=128, help="random: tokens asked for (over --max-tokens)")
    bench.add_argument("--num-prompts", type=int, default=32, help="per prompt set (cycled when the set is smaller)")
    bench.add_argument("--concurrency", help="closed loop: comma-separated levels of clients, each sending its next "
                                             "request when its last one ends (default 1,8,32)")
    bench.add_argument("--request-rate", help="open loop: comma-separated request rates per second (Poisson "
                                              "arrivals; inf: all at once), as vLLM's bench")
    bench.add_argument("--max-concurrency", type=int, help="open loop: at most this many requests in flight")
    bench.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each run")
    bench.add_argument("--max-tokens", type=int, default=256)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, help="request i gets seed + i; also seeds the random set and arrivals")
    bench.add_argument("--ignore-eos", action="store_true", help="always generate the tokens asked for")
    bench.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (grpc, openai)")
    bench.add_argument("--compare", help="embedded: comma-separated engines to compare in this process — ar (the "
                                         "target alone), adaptive, fixed (the drafter under that --speculation) — "
                                         "each run's prompts cut into --slices slices that every engine runs back "
                                         "to back, so that a host whose speed drifts slows them alike; the report "
                                         "adds each engine's tok/s and its ratio to the first, per slice")
    bench.add_argument("--slices", type=int, help="--compare: slices per run (default: 4 for two engines, 6 for "
                                                   "three — a multiple of the engines' orders balances them; fewer "
                                                   "where a slice would hold fewer prompts than the concurrency)")
    bench.add_argument("--passes", type=int, default=1, help="--compare: run everything this many times on the same "
                                                              "engines, each pass with other seeds; their policies "
                                                              "carry what they learnt, as a long-running server's do")
    bench.add_argument("--out", default="bench-results", help="folder for results.json, results.md, results.png")
    bench.set_defaults(run=_bench)

    trn = sub.add_parser("train", help="train a DFlash drafter for a target: regenerate answers with the target, "
                                       "train, write a z-lab checkpoint (dflash-spec §4)")
    trn.add_argument("--target", required=True, help="HF causal LM folder or hub repo id")
    trn.add_argument("--target-revision", help="the target's hub commit or tag (default: the repo's default branch)")
    trn.add_argument("--output", required=True, help="folder for the checkpoint, training state, log and data")
    trn.add_argument("--stage", choices=["all", "data", "train"], help="data: only regenerate answers; "
                     "train: only train on the answers already there; all (default): both")
    data = trn.add_argument_group("data")
    data.add_argument("--prompts", help="comma-separated prompt sets, NAME, NAME:COUNT or NAME[START:STOP] each: sharegpt, stdlib, sitepackages, "
                                        "gsm8k, mbpp, humaneval, math500, alpaca, spec-bench, or a .jsonl file with 'prompt' "
                                        "(default sharegpt,gsm8k,mbpp)")
    data.add_argument("--data-dir", help="the bench-data folder (default ../shared/bench-data)")
    data.add_argument("--answers", help="the regenerated answers, JSON lines (default OUTPUT/answers.jsonl)")
    data.add_argument("--max-new-tokens", type=int, help="answer length cap when regenerating (default 512)")
    data.add_argument("--gen-temperature", type=float, help="0 (default): greedy answers, as greedy serving sees")
    data.add_argument("--gen-batch", type=int, help="sequences decoded at once (default 256)")
    data.add_argument("--samples-per-prompt", type=int, help="answers per prompt (default 1); more need "
                      "--gen-temperature > 0, and a greedy run's answers count as each prompt's first")
    data.add_argument("--gen-max-minutes", type=float, help="stop regenerating after this long; run again to finish")
    model = trn.add_argument_group("drafter (a resumed run keeps its own)")
    model.add_argument("--block-size", type=int, help="default 16")
    model.add_argument("--num-layers", type=int, help="draft layers (default 2)")
    model.add_argument("--num-features", type=int, help="target layers fed to the drafter (default: --num-layers)")
    model.add_argument("--target-layer-ids", help="comma-separated; default: the spec's rule for --num-features")
    model.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's)")
    model.add_argument("--mask-token-id", type=int, help="default: an unused embedding row or spare special token")
    model.add_argument("--init-from", help="start from this drafter checkpoint (folder or hub repo id), e.g. to "
                                           "train a served drafter further on new data; its architecture wins")
    model.add_argument("--init-from-revision", help="the --init-from drafter's hub commit or tag")
    opt = trn.add_argument_group("optimisation")
    opt.add_argument("--gamma", type=float, help="position-weight decay (default 7 for B=16, 5 for B=10, 4 for B=8)")
    opt.add_argument("--lr", type=float, help="peak AdamW learning rate (default 6e-4)")
    opt.add_argument("--warmup-ratio", type=float, help="default 0.04, then cosine to 0")
    opt.add_argument("--grad-clip", type=float, help="default 1.0")
    opt.add_argument("--anchors", type=int, help="blocks per sequence, re-drawn every epoch (default 64)")
    opt.add_argument("--max-seq-len", type=int, help="prompt + answer tokens (default 2048)")
    opt.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    opt.add_argument("--epochs", type=float, help="default 6")
    opt.add_argument("--max-minutes", type=float, help="training-time budget; the schedule ends at whichever of "
                                                        "epochs or time runs out first")
    opt.add_argument("--stop-after-steps", type=int, help="end this invocation after N steps; --resume continues")
    ev = trn.add_argument_group("held-out tau (the saved checkpoint driving the engine, greedy)")
    ev.add_argument("--eval-every", type=int, help="steps between checkpoint + tau (default 500; 0: at the end)")
    ev.add_argument("--eval-prompts", type=int, help="how many prompts (default 32)")
    ev.add_argument("--eval-set", help="a prompt set to measure on (e.g. humaneval); default: prompts held out "
                                       "from the training data")
    ev.add_argument("--eval-max-tokens", type=int, help="default 256")
    trn.add_argument("--resume", action="store_true", help="continue the run in --output (its saved settings win)")
    trn.add_argument("--seed", type=int)
    trn.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    trn.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                     help="auto (default): bf16 autocast on GPU, float32 on CPU")
    trn.set_defaults(run=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
