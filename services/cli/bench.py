"""`dflash bench`: load-test a server or the embedded engine (services/bench/serve_bench.py runs it)."""

from __future__ import annotations

import argparse
import sys

from dflash_serve.services.cli.flags import (
    ENGINE_FLAGS_TITLE,
    add_engine_flags,
    auto_device,
    given_config_flags,
    model_pair,
)
from dflash_serve.services.config import EngineConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="load-test a server (gRPC or OpenAI HTTP) or the embedded engine: tok/s, "
                                          "TTFT, TPOT, ITL, tau and acceptance per load and prompt set; results "
                                          "also under vLLM bench's keys")
    parser.add_argument("--backend", choices=["grpc", "openai", "embedded"], default="grpc",
                        help="grpc: dflash.v1 at --address; openai: streaming /v1/completions or /v1/chat/completions "
                             "at --base-url (ours or vLLM's); embedded: the engine in this process")
    parser.add_argument("--embedded", action="store_const", dest="backend", const="embedded",
                        help="the same as --backend embedded")
    parser.add_argument("--address", default="127.0.0.1:9000", help="grpc: HOST:PORT of a dflash server")
    parser.add_argument("--api-key", help="the server's API key (default: $DFLASH_API_KEY for grpc, "
                        "$OPENAI_API_KEY for openai), sent as `Bearer KEY`")
    parser.add_argument("--base-url", help="openai: the server's URL (default http://127.0.0.1:8000)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                        help="openai: completions send the prompt as is, chat completions as a user message")
    parser.add_argument("--model", help="openai: the model to ask for (default: the first of /v1/models); "
                                        "the API key, if any, is read from OPENAI_API_KEY")
    parser.add_argument("--tokenizer", help="openai: the served model's tokenizer (folder or hub id), for the random "
                                            "set's vocabulary (and its text, for chat completions)")
    parser.add_argument("--metrics-url", help="openai: the server's Prometheus endpoint (ours: a Ray node's "
                                              "metrics port, http://HOST:8080/metrics; vLLM's: BASE_URL/metrics), read "
                                              "before and after each run for tau and acceptance")
    add_engine_flags(parser, "embedded: the engine (" + ENGINE_FLAGS_TITLE + ")",
                     defaults={"max_num_seqs": "the largest load's concurrency, or --num-prompts"})
    parser.add_argument("--dataset", default="random",
                        help="comma-separated: random (--input-len token ids drawn from the vocabulary, "
                             "--output-len tokens asked), or a set read from --data-dir: humaneval, gsm8k, math500, "
                             "mbpp, alpaca, spec-bench, spec-bench/{translation,summarization,qa,math_reasoning,rag}, "
                             "or sharegpt-2turn (conversations: turn 2, with turn 1 and its answer, is sent once the "
                             "answer arrived; --num-prompts counts conversations; latencies reported per turn)")
    parser.add_argument("--data-dir", help="the folder holding the named sets' files (README: 'Benchmark prompt "
                                           "sets' lists them and where they come from)")
    parser.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random: tokens asked for (over --max-tokens)")
    parser.add_argument("--num-prompts", type=int, default=32, help="per prompt set (cycled when the set is smaller)")
    parser.add_argument("--concurrency", help="closed loop: comma-separated levels of clients, each sending its next "
                                              "request when its last one ends (default 1,8,32)")
    parser.add_argument("--request-rate", help="open loop: comma-separated request rates per second (Poisson "
                                               "arrivals; inf: all at once), as vLLM's bench")
    parser.add_argument("--max-concurrency", type=int, help="open loop: at most this many requests in flight")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each run")
    parser.add_argument("--min-seconds", type=float, default=0.0,
                        help="a run shorter than this sends its prompts again until its runs add up to it, and "
                             "reports them pooled (short runs at high concurrency are noisy); not with --compare")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, help="request i gets seed + i; also seeds the random set and arrivals")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the tokens asked for")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (grpc, openai)")
    parser.add_argument("--compare", help="embedded: comma-separated engines to compare in this process — ar (the "
                                          "target alone), adaptive, fixed (the drafter under that --speculation) — "
                                          "each run's prompts cut into --slices slices that every engine runs back "
                                          "to back, so that a host whose speed drifts slows them alike; the report "
                                          "adds each engine's tok/s and its ratio to the first, per slice")
    parser.add_argument("--slices", type=int, help="--compare: slices per run (default: 4 for two engines, 6 for "
                                                    "three — a multiple of the engines' orders balances them; fewer "
                                                    "where a slice would hold fewer prompts than the concurrency)")
    parser.add_argument("--passes", type=int, default=1, help="--compare: run everything this many times on the same "
                                                               "engines, each pass with other seeds; their policies "
                                                               "carry what they learnt, as a long-running server's do")
    parser.add_argument("--out", default="bench-results", help="folder for results.json, results.md, results.png")
    parser.set_defaults(run=run)


def _loads(args: argparse.Namespace) -> list:
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


def _prompt_sets(args: argparse.Namespace, setup: dict, tokenizer) -> dict:
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


def run(args: argparse.Namespace) -> int:
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
        loads = _loads(args)
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
        if args.min_seconds < 0 or (compared and args.min_seconds):
            raise ValueError("--min-seconds must be >= 0, and --compare times its engines on slices of one run "
                             "instead (--passes runs it all again)")
        if args.backend == "embedded":
            from dflash_serve.services.engine.loader import build_engine
            from dflash_serve.services.gc_freeze import freeze_startup_objects

            most = max(load.concurrency or args.num_prompts for load in loads)
            defaults = {"device": auto_device(), "max_num_seqs": most, **model_pair(engine_flags)}
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
        prompt_sets = _prompt_sets(args, setup, tokenizer if chat else None)
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
        runs = run_bench(backend, prompt_sets, loads, sampling, warmup=args.warmup, min_seconds=args.min_seconds)
    setup.update(datasets=list(prompt_sets), num_prompts=args.num_prompts,
                 loads=[load.describe() for load in loads],
                 warmup=args.warmup, min_seconds=args.min_seconds, max_tokens=args.max_tokens,
                 temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos)
    if "random" in prompt_sets:
        setup.update(input_len=args.input_len, output_len=args.output_len)
    paths = write_report(args.out, setup, runs)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0
