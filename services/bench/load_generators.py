"""Load generators: the embedded engine stepped in this process, a gRPC server (`dflash.v1`) and an
OpenAI-compatible HTTP server (ours or vLLM's). Each `run`s a run's items under a load and returns
one `RequestRecord` per request sent."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence

from dflash_serve.services.bench.prompts import Prompt
from dflash_serve.services.bench.summary import (
    PrefixCacheCounters,
    SpecCounters,
    parse_prefix_cache_counters,
    parse_spec_counters,
)
from dflash_serve.services.bench.workload import BenchSampling, Item, Load, RequestRecord, first_prompt, next_prompt

Progress = Callable[[], None]


class EmbeddedBackend:
    """The in-process engine, stepped by this thread: requests join between steps, as on a server."""

    def __init__(self, engine):
        if engine.tokenizer is None:
            raise ValueError("the target has no tokenizer; dflash bench needs one to render the prompts")
        self.engine = engine

    def describe(self) -> dict:
        cfg = self.engine.config
        return {"backend": "embedded", "target": cfg.target, "drafter": cfg.drafter or "",
                "speculation": cfg.speculation if cfg.drafter else "none (AR)",
                "block_size": self.engine.block_size, "device": str(self.engine.device),
                "vocab_size": self.engine.vocab_size, "prefix_caching": cfg.enable_prefix_caching}

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        scheduler = self.engine.scheduler
        return PrefixCacheCounters(scheduler.prefix_cache_queries, scheduler.prefix_cache_hits)

    def step_timings(self):
        """The engine's phase times so far (`StepTimings`, a copy): a run's are the difference."""
        return self.engine.timings.copy()

    def policy_estimates(self, n: int, context: float | None) -> dict | None:
        """The adaptive policy's view of a batch of n (at most the engine's largest) at mean position
        `context` now (`SpeculationPolicy.estimates`); None where no adaptive choice runs."""
        policy = self.engine.speculation
        if not policy.adapts or policy.costs is None:
            return None
        return policy.estimates(min(n, self.engine.config.max_num_seqs), context)

    def clear_prefix_cache(self) -> None:
        """Forget what earlier runs cached (nothing is running between runs), so that a run finds
        only what its own requests left: not its warm-up's prompts, nor an earlier load's."""
        self.engine.allocator.reset_prefix_cache()

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        tok = self.engine.tokenizer
        if tok.chat_template:
            return list(tok.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
        if prompt.history:
            raise ValueError("the target's tokenizer has no chat template to render a conversation with")
        return tok.encode(prompt.text)

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        from dflash_serve.services.engine.sampling_params import SamplingParams
        from dflash_serve.services.engine.stopping import FinishReason

        engine, records = self.engine, []
        active: dict[str, tuple[RequestRecord, int, Prompt]] = {}  # request id -> (record, item index, prompt)
        follow_ups: list[tuple[int, Prompt]] = []  # next turns whose previous answer has arrived
        due = load.arrival_offsets(len(items)) if load.request_rate is not None else [0.0] * len(items)
        cap = load.concurrency or len(items)
        start, sent, open_items = time.perf_counter(), 0, 0

        def submit(index: int, prompt: Prompt) -> None:
            nonlocal open_items
            params = SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens_for(prompt),
                                    seed=sampling.request_seed(index), ignore_eos=sampling.ignore_eos)
            record = RequestRecord(start=time.perf_counter(), turn=prompt.turn)
            records.append(record)
            try:
                active[engine.add_request(self._prompt_ids(prompt), params)] = (record, index, prompt)
            except ValueError:  # what the server answers with INVALID_ARGUMENT; the item ends here
                record.error = "INVALID_ARGUMENT"
                open_items -= 1
                progress()

        while sent < len(items) or active or follow_ups:
            for index, prompt in follow_ups:  # first: their clients are waiting already
                submit(index, prompt)
            follow_ups.clear()
            now = time.perf_counter()
            while sent < len(items) and open_items < cap and start + due[sent] <= now:
                open_items += 1
                sent += 1
                submit(sent - 1, first_prompt(items[sent - 1]))
            if not active:
                if sent < len(items):  # open loop, idle until the next arrival
                    time.sleep(max(0.0, start + due[sent] - time.perf_counter()))
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id not in active:
                    continue
                record, index, prompt = active[out.request_id]
                record.tokens_arrived(now, len(out.new_token_ids))
                record.text.append(out.new_text)
                if not out.finished:
                    continue
                del active[out.request_id]
                engine.release(out.request_id)
                record.end = now
                record.input_tokens, record.output_tokens = out.num_prompt_tokens, out.num_output_tokens
                if out.finish_reason is FinishReason.ERROR:
                    record.error = "INTERNAL"
                _take_stats(record, out.stats.rounds, out.stats.draft_tokens, out.stats.accepted_tokens,
                            out.stats.accepted_per_position)
                following = None if record.error else next_prompt(items[index], prompt, record.answer)
                if following is not None:
                    follow_ups.append((index, following))
                else:
                    open_items -= 1
                    progress()
        return records


async def _drive(items: Sequence[Item], load: Load, send: Callable[[int, Prompt], Awaitable[RequestRecord]],
                 progress: Progress) -> list[RequestRecord]:
    """Sends every item through `send` (which streams one request and returns its record; a
    conversation's turns one after the other, each once the answer before it has arrived) under the
    load: closed-loop clients, or Poisson arrivals with at most `concurrency` items in flight."""
    records: list[RequestRecord] = []

    async def one(index: int, item: Item) -> None:
        prompt = first_prompt(item)
        while prompt is not None:
            record = await send(index, prompt)
            record.turn = prompt.turn
            records.append(record)
            prompt = None if record.error else next_prompt(item, prompt, record.answer)
        progress()

    if load.request_rate is None:
        queue = list(enumerate(items))[::-1]  # popped from the end: in order

        async def client() -> None:
            while queue:
                await one(*queue.pop())

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
        return records
    in_flight = asyncio.Semaphore(load.concurrency or len(items) or 1)

    async def bounded(index: int, item: Item) -> None:
        async with in_flight:  # the request's clock starts when it is sent, as in vLLM's bench
            await one(index, item)

    start, tasks = time.perf_counter(), []
    for index, (item, due) in enumerate(zip(items, load.arrival_offsets(len(items)))):
        await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        tasks.append(asyncio.create_task(bounded(index, item)))
    await asyncio.gather(*tasks)
    return records


class GrpcBackend:
    """Streams `dflash.v1.Generation/Generate` calls over one channel."""

    def __init__(self, address: str, timeout: float = 600.0, api_key: str | None = None):
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def describe(self) -> dict:
        from dflash_serve.services.client import model_info

        info = model_info(self.address, timeout=10, metadata=self.metadata)
        return {"backend": "grpc", "address": self.address, "target": info.target, "drafter": info.drafter,
                "target_revision": info.target_revision, "drafter_revision": info.drafter_revision,
                "block_size": info.block_size, "topology": info.topology, "vocab_size": info.vocab_size}

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        return asyncio.run(self._run(items, sampling, load, progress))

    async def _run(self, items, sampling, load, progress) -> list[RequestRecord]:
        import grpc

        from dflash_serve.services.api.dflash.v1 import generation_pb2_grpc
        from dflash_serve.services.client import build_request

        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def send(index: int, prompt: Prompt) -> RequestRecord:
                params = {"max_tokens": sampling.max_tokens_for(prompt), "temperature": sampling.temperature,
                          "ignore_eos": sampling.ignore_eos}
                if sampling.seed is not None:
                    params["seed"] = sampling.request_seed(index)
                if prompt.token_ids is not None:
                    request = build_request(token_ids=prompt.token_ids, sampling=params)
                else:
                    request = build_request(chat=prompt.messages(), sampling=params)
                record = RequestRecord(start=time.perf_counter())
                await self._one(stub, request, record)
                return record

            return await _drive(items, load, send, progress)

    async def _one(self, stub, request, record: RequestRecord) -> None:
        import grpc

        last = None
        try:
            async for response in stub.Generate(request, timeout=self.timeout, metadata=self.metadata):
                record.tokens_arrived(time.perf_counter(), len(response.token_ids))
                record.text.append(response.text)
                last = response
        except grpc.aio.AioRpcError as err:
            record.error = err.code().name
        record.end = time.perf_counter()
        if record.error is None and (last is None or not last.HasField("usage")):
            record.error = "INCOMPLETE"  # the stream ended without its final message
        if record.error is None:
            stats = last.spec_stats
            record.input_tokens, record.output_tokens = last.usage.prompt_tokens, last.usage.completion_tokens
            _take_stats(record, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                        stats.accepted_per_position)


class OpenAIBackend:
    """Streams OpenAI completions or chat completions over HTTP (SSE), as `vllm bench serve
    --backend openai` / `openai-chat` does: against our server's HTTP API or vLLM's own."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, base_url: str, endpoint: str = "/v1/completions", model: str | None = None,
                 api_key: str | None = None, metrics_url: str | None = None, tokenizer=None,
                 timeout: float = 600.0):
        if endpoint not in self.ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(self.ENDPOINTS)}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint, self.model, self.metrics_url = endpoint, model, metrics_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer  # optional: the random set's vocabulary, and its text for chat
        self.timeout = timeout

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def describe(self) -> dict:
        import httpx

        # Asked even with --model: a wrong address or API key fails here, not in every request.
        reply = httpx.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=10)
        reply.raise_for_status()
        if self.model is None:  # the server's first model, as vLLM's bench takes it
            models = reply.json().get("data") or []
            if not models:
                raise ValueError(f"{self.base_url}/v1/models lists no model; give --model")
            self.model = models[0]["id"]
        setup = {"backend": "openai", "base_url": self.base_url, "endpoint": self.endpoint, "target": self.model,
                 "drafter": "", "metrics_url": self.metrics_url}
        if self.tokenizer is not None:
            setup["vocab_size"] = len(self.tokenizer)
        return setup

    def _scrape(self) -> str:
        import httpx

        reply = httpx.get(self.metrics_url, timeout=10)
        reply.raise_for_status()
        return reply.text

    def spec_counters(self) -> SpecCounters | None:
        """The server's speculative-decoding counters now (None without --metrics-url)."""
        return None if self.metrics_url is None else parse_spec_counters(self._scrape())

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        """The server's prefix-cache counters now (None without --metrics-url)."""
        return None if self.metrics_url is None else parse_prefix_cache_counters(self._scrape())

    def payload(self, index: int, prompt: Prompt, sampling: BenchSampling) -> dict:
        body = {"model": self.model, "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            if not prompt.text:
                raise ValueError("token prompts go to /v1/completions; for chat, --tokenizer renders them as text")
            body["messages"] = prompt.messages()
            body["max_completion_tokens"] = sampling.max_tokens_for(prompt)
        elif prompt.history:
            raise ValueError("a conversation's later turns need the chat template: use --endpoint /v1/chat/completions")
        else:
            body["prompt"] = list(prompt.token_ids) if prompt.token_ids is not None else prompt.text
            body["max_tokens"] = sampling.max_tokens_for(prompt)
        if sampling.seed is not None:
            body["seed"] = sampling.request_seed(index)
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension to the OpenAI API
        return body

    def run(self, items: Sequence[Item], sampling: BenchSampling, load: Load,
            progress: Progress = lambda: None) -> list[RequestRecord]:
        return asyncio.run(self._run(items, sampling, load, progress))

    async def _run(self, items, sampling, load, progress) -> list[RequestRecord]:
        # aiohttp, as vLLM's bench: at c 32 httpx reads a stream's first event 6-14 ms after the
        # request on the CI machine, aiohttp 1.7-2 ms (`bench.sse_clients`, BENCHMARKS), and the
        # served TTFT would carry the difference.
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.timeout)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout, read_bufsize=SSE_READ_BUFSIZE,
                                         connector=aiohttp.TCPConnector(limit=0)) as client:

            async def send(index: int, prompt: Prompt) -> RequestRecord:
                body = self.payload(index, prompt, sampling)
                record = RequestRecord(start=time.perf_counter())
                try:
                    await self._one(client, body, record)
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    record.error = _http_error_code(err)
                record.end = time.perf_counter()
                return record

            return await _drive(items, load, send, progress)

    async def _one(self, client, body: dict, record: RequestRecord) -> None:
        async with client.post(self.base_url + self.endpoint, json=body) as response:
            if response.status != 200:
                await response.read()
                record.error = f"HTTP_{response.status}"
                return
            usage, done = None, False
            async for raw in response.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if done or not line.startswith("data:"):
                    continue  # blank separators, SSE comments and fields; anything after [DONE]
                data = line[len("data:"):].strip()
                if data == "[DONE]":  # read on to the body's end: a connection left mid-body is closed, not reused
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream began (vLLM sends one as data)
                    record.error = "STREAM_ERROR"
                    return
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                    if text:
                        record.tokens_arrived(time.perf_counter(), 1)  # a chunk does not say its tokens
                        record.text.append(text)
                usage = chunk.get("usage") or usage
        if not done or usage is None:
            record.error = "INCOMPLETE"  # no [DONE], or no usage although include_usage asked for it
            return
        record.input_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]


# An SSE line longer than aiohttp's default read buffer (64 KiB) would fail the stream; a chunk
# carrying a long text or the final statistics stays well under this.
SSE_READ_BUFSIZE = 1 << 20


def _http_error_code(err: BaseException) -> str:
    """A failed request's error code: ConnectError (nothing listens), ReadTimeout, or the
    exception's type (ServerDisconnectedError, ...)."""
    import aiohttp

    if isinstance(err, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(err, asyncio.TimeoutError):
        return "ReadTimeout"
    return type(err).__name__


def _take_stats(record: RequestRecord, rounds: int, drafted: int, accepted: int, per_position) -> None:
    record.rounds, record.draft_tokens, record.accepted_tokens = rounds, drafted, accepted
    record.accepted_per_position = list(per_position)
