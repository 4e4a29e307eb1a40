# SPDX-License-Identifier: Apache-2.0
"""Checks of a running OpenAI-compatible vLLM server before a long run."""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from eval.serve import SERVED_DIR

NETWORK_ERRORS = (urllib.error.URLError, OSError, ValueError)
SERVED_MODEL_NAME = "Kimi-K3"  # the arms' --served-model-name


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every run against a serving arm takes."""
    parser.add_argument(
        "--arm", required=True, help="the arm the server runs (eval/arms.toml)"
    )
    parser.add_argument(
        "--base-url", required=True, help="the server, e.g. http://10.0.0.1:8691"
    )
    parser.add_argument(
        "--served-model-name",
        default=SERVED_MODEL_NAME,
        help="the served model name (make: SERVED_MODEL=; default "
        f"{SERVED_MODEL_NAME})",
    )
    parser.add_argument(
        "--checkpoint",
        default="",
        help="the served model's checkpoint directory (make: CHECKPOINT=)",
    )
    parser.add_argument(
        "--model",
        default="",
        help="make's MODEL=, the checkpoint directory as in `make serve` and the "
        "seed; a served model name here is refused, naming SERVED_MODEL=",
    )
    parser.add_argument("--target", help="vLLM whose patch state to record")
    parser.add_argument(
        "--served",
        type=Path,
        default=SERVED_DIR,
        help="where `make serve RUN=1` recorded how each arm was started "
        "(default: results/served)",
    )


def resolve_model_names(args: argparse.Namespace) -> None:
    """Take ``--model`` (make's MODEL=) as the checkpoint, as ``make serve``
    does; refuse its old meaning, the served model name, by the new name."""
    if not args.model:
        return
    if "/" not in args.model and not Path(args.model).is_dir():
        raise ServerError(
            f"MODEL={args.model} (--model): MODEL= is the checkpoint directory, "
            "as for `make serve`; the served model name is SERVED_MODEL= "
            f"(--served-model-name, default {SERVED_MODEL_NAME}): set "
            f"SERVED_MODEL={args.model} instead"
        )
    args.checkpoint = args.checkpoint or args.model


class ServerError(Exception):
    """The server is missing, serves something else, or is set up wrongly."""


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def serve_hint(arm: str) -> str:
    return (
        f"make serve ARM={arm} NODE_RANK=0 CHECKPOINT=/path/to/Kimi-K3 "
        "MASTER_ADDR=... HOST_IP=... DEEPGEMM=... RUN=1 (and NODE_RANK=1 on "
        "the second node)"
    )


def check_server(base_url: str, model: str, arm: str) -> str:
    """Fail unless the server lists ``model``; return its vLLM version."""
    url = f"{base_url}/v1/models"
    try:
        served = [entry["id"] for entry in json.loads(get(url))["data"]]
    except (*NETWORK_ERRORS, KeyError) as error:
        raise ServerError(
            f"no OpenAI-compatible server at {url} ({error}); start it with: "
            f"{serve_hint(arm)}"
        ) from error
    if model not in served:
        raise ServerError(
            f"{url} serves {served}, not {model!r}: set SERVED_MODEL= to the "
            f"served model name (--served-model-name), or start the arm with: "
            f"{serve_hint(arm)}"
        )
    try:
        return str(json.loads(get(f"{base_url}/version")).get("version", "unknown"))
    except NETWORK_ERRORS:
        return "unknown"


PROBE_PROMPT = "A prefix-cache probe, the same prompt twice. " * 8
PROBE_WAIT_S = 15.0  # for the counters to count the probe's prompt tokens
COUNTERS = {
    "queries": "vllm:prefix_cache_queries",
    "hits": "vllm:prefix_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
}


def counters(text: str) -> dict[str, float]:
    """The ``COUNTERS`` vLLM exports in ``/metrics`` text, summed over their
    labels (one series per engine); a counter the text lacks is left out.
    Prometheus names a counter's sample ``NAME_total``; both are read."""
    found: dict[str, float] = {}
    for key, name in COUNTERS.items():
        pattern = rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)"
        values = re.findall(pattern, text, re.M)
        if values:
            found[key] = sum(float(value) for value in values)
    return found


def complete_once(base_url: str, model: str, prompt: str) -> int:
    """One single-token completion; the prompt tokens the server counted."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return int(json.load(response)["usage"]["prompt_tokens"])


def prefix_caching(base_url: str, model: str) -> tuple[bool | None, dict]:
    """Whether the server caches prefixes, and the evidence.

    Both of vLLM's frontends export the prefix-cache counters (the Rust one
    has no ``cache_config_info``), and the scheduler counts a query only when
    caching is on: the same prompt is sent twice and the counters are read
    before and after, once ``prompt_tokens`` has counted both prompts (the
    counters are updated after the response returns; the Rust frontend shows
    ``prompt_tokens`` only once it has counted some). ``None``: the server
    does not say (no counters, or they did not count the probe).
    """
    evidence: dict = {"probe": "the same prompt twice, one output token each"}
    try:
        before = counters(get(f"{base_url}/metrics").decode())
        if "queries" not in before:
            evidence["observed"] = f"/metrics has no {COUNTERS['queries']}"
            return None, evidence
        sent = sum(complete_once(base_url, model, PROBE_PROMPT) for _ in range(2))
        deadline = time.monotonic() + PROBE_WAIT_S
        while True:
            after = counters(get(f"{base_url}/metrics").decode())
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
            if delta["prompt_tokens"] >= sent or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except (*NETWORK_ERRORS, KeyError) as error:
        evidence["observed"] = f"the probe failed: {error}"
        return None, evidence
    evidence["prompt_tokens_sent"] = sent
    evidence.update({key: int(value) for key, value in delta.items()})
    counted = (
        f"{int(delta['queries'])} prefix-cache queries and {int(delta['hits'])} "
        f"hits for the {sent} prompt tokens sent ({COUNTERS['queries']}, "
        f"{COUNTERS['hits']})"
    )
    if delta["prompt_tokens"] < sent:
        evidence["observed"] = (
            f"{COUNTERS['prompt_tokens']} counted {int(delta['prompt_tokens'])} "
            f"of the {sent} prompt tokens sent in {PROBE_WAIT_S:g} s"
        )
        return None, evidence
    evidence["observed"] = f"/metrics counted {counted}"
    return delta["queries"] > 0, evidence
