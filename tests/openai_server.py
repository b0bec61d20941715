"""A small HTTP server on 127.0.0.1 that speaks the OpenAI streaming protocol as vLLM's server
does, for testing `dflash bench --backend openai` over a real socket: /v1/models, streaming
/v1/completions and /v1/chat/completions (SSE `data: {...}` chunks, `usage` in a last chunk when
`stream_options.include_usage`, then `data: [DONE]`), and /metrics with vLLM's speculative-decoding
and prefix-cache counters, which every completed request advances by a known amount. With `api_key`, every route
but /metrics wants `Authorization: Bearer KEY`, as vLLM's `--api-key`. Every request's
Authorization header is kept, to show what a client sent.

Prompts ask for behaviour: "fail-400" is refused with HTTP 400; "fail-mid" streams one chunk,
then an error chunk, as vLLM reports an error after the stream began."""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "toy-model"
TOKENS_PER_CHUNK = 2  # as a speculative server streams a round's tokens together
# What one completed request adds to the counters: 2 rounds of 5 drafts, 3 accepted (2 + 1).
DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS = 2, 10, 3, (2, 1, 0, 0, 0)
# And to the prefix-cache counters: prompt tokens looked up, and found.
CACHE_QUERIES, CACHE_HITS = 8, 6


class OpenAIProtocolServer:
    def __init__(self, api_key: str | None = None):
        self.api_key = api_key
        self.requests: list[dict] = []  # the bodies of the completion requests, in arrival order
        self.authorizations: list[str | None] = []  # each request's Authorization header (/metrics aside)
        self.completed = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> OpenAIProtocolServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def metrics_text(self) -> str:
        n = self.completed
        lines = [f'vllm:spec_decode_num_drafts_total{{model_name="{MODEL}"}} {DRAFTS * n}.0',
                 f'vllm:spec_decode_num_draft_tokens_total{{model_name="{MODEL}"}} {DRAFT_TOKENS * n}.0',
                 f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}} {ACCEPTED * n}.0']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="{j}"}} '
                  f'{count * n}.0' for j, count in enumerate(ACCEPTED_PER_POS)]
        lines += [f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} {CACHE_QUERIES * n}.0',
                  f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {CACHE_HITS * n}.0']
        return "# TYPE vllm:spec_decode_num_drafts counter\n" + "\n".join(lines) + "\n"

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:  # /metrics stays open, as on vLLM's server
                sent = self.headers.get("Authorization")
                with server.lock:
                    server.authorizations.append(sent)
                return not server.api_key or sent == f"Bearer {server.api_key}"

            def _error(self, status: HTTPStatus, message: str) -> None:
                self._json(status, {"object": "error", "message": message, "type": status.phrase, "code": status})

            def do_GET(self):  # noqa: N802 - http.server's names
                if self.path == "/v1/models" and not self._authorized():
                    self._error(HTTPStatus.UNAUTHORIZED, "bad API key")
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                elif self.path == "/metrics":
                    data = server.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

            def do_POST(self):  # noqa: N802
                chat = self.path == "/v1/chat/completions"
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
                if not self._authorized():
                    return self._error(HTTPStatus.UNAUTHORIZED, "bad API key")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                if body.get("model") != MODEL or not body.get("stream"):
                    return self._error(HTTPStatus.BAD_REQUEST, "unknown model, or not streaming")
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                if prompt == "fail-400":
                    return self._error(HTTPStatus.BAD_REQUEST, "refused as asked")
                max_tokens = body["max_completion_tokens"] if chat else body["max_tokens"]
                prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

                def send(payload) -> None:
                    data = payload if isinstance(payload, str) else json.dumps(payload)
                    self.wfile.write(f"data: {data}\n\n".encode())
                    self.wfile.flush()

                def choice(text: str, finish: str | None) -> dict:
                    if chat:
                        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                    return {"index": 0, "text": text, "finish_reason": finish}

                kind = "chat.completion.chunk" if chat else "text_completion"
                for start in range(0, max_tokens, TOKENS_PER_CHUNK):
                    count = min(TOKENS_PER_CHUNK, max_tokens - start)
                    last = start + count == max_tokens
                    send({"id": "cmpl-1", "object": kind, "model": MODEL,
                          "choices": [choice("x" * count, "length" if last else None)]})
                    if prompt == "fail-mid":
                        send({"error": {"object": "error", "message": "engine died", "type": "InternalServerError",
                                        "code": 500}})
                        return
                if (body.get("stream_options") or {}).get("include_usage"):
                    send({"id": "cmpl-1", "object": kind, "model": MODEL, "choices": [],
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                    "total_tokens": prompt_tokens + max_tokens}})
                with server.lock:
                    server.completed += 1
                send("[DONE]")

        return Handler
