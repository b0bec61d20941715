"""CPU benchmark of incremental detokenization: tokenizers' DecodeStream against the window
decode it replaced, on 4k-token outputs of a real tokenizer.

    python -m dflash_serve.services.bench.detokenizer [--tokenizer DIR] [--tokens 4096] [--out detok.json]

Both run the engine's IncrementalDetokenizer on the same ids: with the tokenizer as the engine
loads it (AutoTokenizer: DecodeStream on its Rust backend), and with that tokenizer seen only
through its Python decode() (the window path: two decodes of the last emitted tokens plus the new
ones per step, as every step did before DecodeStream). Rounds of 1 token are autoregressive
decoding, and every step of a request with stop strings; rounds of 8 are a speculative round's
emitted tokens. Each case checks that both stream the same pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sysconfig
import time

from dflash_serve.services.engine.stopping import IncrementalDetokenizer

# Real output-like text: Python source, prose, and multi-byte characters that span several tokens.
MULTILINGUAL = "naïve café, 中文字符, Ελληνικά, русский, עברית, हिन्दी, 日本語のテキスト, emoji 🙂🚀.\n"


class PythonDecode:
    """The tokenizer seen only through decode(): what the window path runs on."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def output_ids(tokenizer, num_tokens: int) -> list[int]:
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in ("textwrap.py", "string.py", "difflib.py", "argparse.py"):
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            chunks += [MULTILINGUAL, f.read()]
    ids = tokenizer.encode("".join(chunks), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise SystemExit(f"the text gives only {len(ids)} tokens; ask for fewer with --tokens")
    return ids[:num_tokens]


def stream(tokenizer, prompt: list[int], ids: list[int], round_size: int) -> tuple[float, list[str]]:
    """(seconds, streamed pieces) for one request's output, fed in rounds of round_size."""
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(ids[i : i + round_size]) for i in range(0, len(ids), round_size)]
    pieces.append(detok.flush())
    return time.perf_counter() - start, pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a tokenizer folder or hub id (default: the default target, "
                        "SmolLM2-135M-Instruct, from dflash fetch-default)")
    parser.add_argument("--tokens", type=int, default=4096, help="output tokens per request")
    parser.add_argument("--rounds", default="1,8", help="tokens per step, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per case; the median is reported")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from dflash_serve.services.models.default_pair import default_target

        args.tokenizer = default_target()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write some code."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    ids = output_ids(tokenizer, args.tokens)
    paths = {"window (Python decode)": PythonDecode(tokenizer), "DecodeStream": tokenizer}
    results = []
    print(f"{args.tokens} output tokens, {args.tokenizer}, {platform.processor() or platform.machine()}")
    print(f"{'tokens/step':>11} | {'path':<22} | {'ms / request':>12} | {'µs / token':>10} | speed-up")
    for round_size in (int(r) for r in args.rounds.split(",")):
        reference, times = None, {}
        for name, tok in paths.items():
            runs = [stream(tok, prompt, ids, round_size) for _ in range(args.repeats)]
            if reference is None:
                reference = runs[0][1]
            elif runs[0][1] != reference:
                raise SystemExit(f"{name} streamed other text than the window path at {round_size} tokens/step")
            times[name] = statistics.median(seconds for seconds, _ in runs)
        base = times["window (Python decode)"]
        for name, seconds in times.items():
            row = {"tokens_per_step": round_size, "path": name, "ms_per_request": seconds * 1e3,
                   "us_per_token": seconds * 1e6 / args.tokens, "speedup": base / seconds}
            results.append(row)
            print(f"{round_size:>11} | {name:<22} | {row['ms_per_request']:>12.1f} | {row['us_per_token']:>10.2f} | "
                  f"{row['speedup']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokenizer": args.tokenizer, "tokens": args.tokens, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
