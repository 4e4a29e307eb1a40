# SPDX-License-Identifier: Apache-2.0
"""Checks of a running OpenAI-compatible vLLM server before a long run."""

from __future__ import annotations

import argparse
import json
import re
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


def prefix_caching(base_url: str) -> bool | None:
    """Whether the server caches prefixes, from vLLM's ``cache_config_info``
    metric; ``None`` when the server does not say."""
    try:
        text = get(f"{base_url}/metrics").decode()
    except NETWORK_ERRORS:
        return None
    match = re.search(
        r'^vllm:cache_config_info\{[^}]*enable_prefix_caching="(\w+)"', text, re.M
    )
    return None if match is None else match[1].lower() == "true"
