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
# lm-eval's own --model names its client, not the served model: the clients
# of an OpenAI-compatible server (lm_eval/models/openai_completions.py).
LM_EVAL_API_MODELS = (
    "local-completions",
    "local-chat-completions",
    "openai-completions",
    "openai-chat-completions",
    "azure-openai-chat-completions",
)
# Routes the clients add to --base-url (vllm bench serve its --endpoint,
# lm-eval's base_url= is /v1/completions itself); longest first.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every run against a serving arm takes. Those that
    ``vllm bench serve`` also takes (``--base-url``, ``--model``,
    ``--served-model-name``, ``--tokenizer``) mean what they mean there;
    ``resolve_server_arguments`` reads them as it does."""
    parser.add_argument(
        "--arm", required=True, help="the arm the server runs (eval/arms.toml)"
    )
    parser.add_argument(
        "--base-url",
        required=True,
        help="the server's root, as vllm bench serve's --base-url, e.g. "
        "http://10.0.0.1:8691; the clients add the /v1/... routes",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the served model name, the one every request carries, as vllm "
        "bench serve's --model and lm-eval's model_args model= (make: "
        f"SERVED_MODEL=; default {SERVED_MODEL_NAME}); a checkpoint directory "
        "here is refused, naming --tokenizer and --checkpoint",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="as vllm bench serve's: the name requests carry instead of "
        "--model, which then names the model itself (the tokenizer's default)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer, path or name, as vllm bench serve's --tokenizer "
        "(make: TOKENIZER=; default: --model beside --served-model-name, else "
        "--checkpoint); GSM8K sends text and loads none",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="the served model's checkpoint directory, as `make serve` takes "
        "it (make: CHECKPOINT=, or MODEL= as the seed exports it)",
    )
    parser.add_argument("--target", help="vLLM whose patch state to record")
    parser.add_argument(
        "--served",
        type=Path,
        default=SERVED_DIR,
        help="where `make serve RUN=1` recorded how each arm was started "
        "(default: results/served)",
    )


def looks_like_a_path(text: str) -> bool:
    """A directory or file path, not a served name or a hub id."""
    return text.startswith(("/", "./", "../", "~")) or Path(text).expanduser().is_dir()


def resolve_server_arguments(args: argparse.Namespace) -> None:
    """Read the options ``vllm bench serve`` shares as it reads them: the
    requests carry ``--served-model-name``, else ``--model``; the tokenizer
    is ``--tokenizer``, else the model (``--model`` beside
    ``--served-model-name``, else ``--checkpoint``). Sets ``model_name``
    (what requests carry), ``tokenizer`` and ``checkpoint``, and refuses the
    values of another meaning before any server is asked, naming the option
    they belong to."""
    args.base_url = args.base_url.rstrip("/")
    for route in ROUTES:
        if args.base_url.endswith(route):
            root = args.base_url.removesuffix(route)
            raise OptionError(
                f"--base-url {args.base_url} (make: BASE_URL=) ends in {route}: it "
                "is the server's root, as vllm bench serve's --base-url, and the "
                "clients add the routes (lm-eval's base_url= becomes "
                f"{root}/v1/completions): pass --base-url {root}"
            )
    if args.model in LM_EVAL_API_MODELS:
        raise OptionError(
            f"--model {args.model} is lm-eval's client (lm_eval --model); here "
            "--model is the served model name, lm-eval's model_args model= "
            f"(make: SERVED_MODEL=, default {SERVED_MODEL_NAME}); GSM8K runs "
            "lm-eval's local-completions itself"
        )
    bare = args.checkpoint and "/" not in args.checkpoint
    if bare and not Path(args.checkpoint).is_dir():
        raise OptionError(
            f"--checkpoint {args.checkpoint} (make: CHECKPOINT=, or MODEL= as the "
            "seed exports it) is no directory: it is the served model's "
            "checkpoint, as for `make serve`; the served model name is --model "
            f"(make: SERVED_MODEL=, default {SERVED_MODEL_NAME}): pass --model "
            f"{args.checkpoint} (SERVED_MODEL={args.checkpoint}) instead"
        )
    model_id = None  # vllm bench serve's model: the tokenizer's default
    if args.served_model_name:
        args.model_name = args.served_model_name
        model_id = args.model
    elif args.model and looks_like_a_path(args.model):
        raise OptionError(
            f"--model {args.model} is a path: --model is the served model name, "
            "the one every request carries, as vllm bench serve's --model and "
            f"lm-eval's model= (make: SERVED_MODEL=, default {SERVED_MODEL_NAME}). "
            f"Pass the checkpoint as --tokenizer {args.model}, as vllm bench "
            f"serve takes it, or --checkpoint {args.model} (make: CHECKPOINT= or "
            "MODEL=)"
        )
    else:
        args.model_name = args.model or SERVED_MODEL_NAME
    if model_id and looks_like_a_path(model_id):
        args.checkpoint = args.checkpoint or model_id
    args.tokenizer = args.tokenizer or model_id or args.checkpoint or ""
    args.checkpoint = args.checkpoint or ""


class OptionError(Exception):
    """An option given a value of another meaning, with the option to use."""


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
            f"served model name (--model), or start the arm with: "
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
