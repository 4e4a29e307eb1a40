# SPDX-License-Identifier: Apache-2.0
"""A small OpenAI-compatible HTTP server of the tests' own, on 127.0.0.1.

It answers ``GET /v1/models``, ``GET /version`` and ``POST /v1/completions``
with whatever ``complete(prompt)`` returns, so the tools run end to end
against a real socket without a GPU or the network.
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
def serving(model: str, complete: Callable[[str], str]) -> Iterator[str]:
    """Serve until the block ends; yields the base URL."""
    requests: list[dict] = []

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
            else:
                self.reply(404, {"error": self.path})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if self.path != "/v1/completions" or body.get("model") != model:
                self.reply(404, {"error": f"{self.path} {body.get('model')}"})
                return
            prompts = body["prompt"]
            prompts = [prompts] if isinstance(prompts, str) else prompts
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
