# SPDX-License-Identifier: Apache-2.0
"""A small OpenAI-compatible HTTP server of the tests' own, on 127.0.0.1.

It answers ``GET /v1/models``, ``GET /version``, ``GET /metrics`` (the
prefix-cache counters as either of vLLM's frontends exports them) and
``POST /v1/completions`` with whatever ``complete(prompt)`` returns, so the
tools' server checks and lm-eval run against a real socket without a GPU or
the network. The tests of tests/serving meet real ``vllm serve`` servers.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VLLM_VERSION = "0.33.0"


@contextmanager
def serving(
    model: str,
    complete: Callable[[str], str] = lambda prompt: "",
    prefix_caching: bool | None = False,
    frontend: str = "python",
) -> Iterator[str]:
    """Serve until the block ends; yields the base URL.

    The counters count a prompt's characters as its tokens, as vLLM's
    scheduler does: prefix-cache queries only with ``prefix_caching`` on, and
    hits for a prompt seen before. ``prefix_caching`` None leaves them out, as
    a server that does not report them. ``frontend`` "python" adds
    ``cache_config_info``, which the Rust frontend ("rust") does not export.
    """
    counted = {"queries": 0, "hits": 0, "prompt_tokens": 0}
    seen: set[str] = set()

    def metrics() -> bytes:
        if prefix_caching is None:
            return b"# vLLM metrics\n"
        labels = f'engine="0",model_name="{model}"'
        # prometheus_client (the Python frontend) adds NAME_created samples.
        created = f"vllm:{{}}_created{{{{{labels}}}}} 1.7e9\n"
        text = "".join(
            f"# TYPE vllm:{name} counter\nvllm:{name}_total{{{labels}}} "
            f"{counted[key]}.0\n"
            + (created.format(name) if frontend == "python" else "")
            for key, name in (
                ("queries", "prefix_cache_queries"),
                ("hits", "prefix_cache_hits"),
                ("prompt_tokens", "prompt_tokens"),
            )
            # vllm-rs shows prompt_tokens once it has counted some.
            if key != "prompt_tokens" or counted[key] or frontend == "python"
        )
        if frontend == "python":
            text += (
                'vllm:cache_config_info{block_size="16",'
                f'enable_prefix_caching="{prefix_caching}"}} 1.0\n'
            )
        return text.encode()

    def count(prompt: str) -> None:
        counted["prompt_tokens"] += len(prompt)
        if prefix_caching:
            counted["queries"] += len(prompt)
            counted["hits"] += len(prompt) - 1 if prompt in seen else 0
        seen.add(prompt)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": model}]})
            elif self.path == "/version":
                self.reply(200, {"version": VLLM_VERSION})
            elif self.path == "/metrics":
                data = metrics()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self.reply(404, {"error": self.path})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("model") != model:
                self.reply(404, {"error": f"{self.path} {body.get('model')}"})
                return
            prompts = body["prompt"]
            prompts = [prompts] if isinstance(prompts, str) else prompts
            for prompt in prompts:
                count(prompt)
            self.reply(
                200,
                {
                    "object": "text_completion",
                    "model": model,
                    "choices": [
                        {
                            "index": i,
                            "text": complete(p),
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                        for i, p in enumerate(prompts)
                    ],
                    "usage": {"prompt_tokens": sum(map(len, prompts))},
                },
            )

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def gsm8k_answerer(test_file: Path, wrong: bool = False) -> Callable[[str], str]:
    """Answer the last ``Question:`` of a few-shot prompt from ``test_file``;
    ``wrong`` adds one to every final answer."""
    answers = {}
    for line in test_file.read_text().splitlines():
        doc = json.loads(line)
        answers[doc["question"]] = doc["answer"]

    def complete(prompt: str) -> str:
        question = prompt.rsplit("Question:", 1)[-1].split("\nAnswer:")[0].strip()
        answer = answers.get(question, "I do not know.\n#### 0")
        if wrong:
            answer = re.sub(r"#### (-?\d+)", lambda m: f"#### {int(m[1]) + 1}", answer)
        return f" {answer}\n\n"

    return complete
