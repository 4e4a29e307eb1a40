# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages announce what they run before any PP traffic.

A collective on the PP group returns only when every stage joins it: a stage
without this series (stock vLLM 0.33.0), or with a revision that exchanges
other rounds, never joins, and both sides wait for gloo's 30 minutes. Each
stage therefore writes its announcement (protocol version, series revision,
vLLM version, host) to the c10d store behind the distributed init, which
answers without the peer, and polls for the others' within a bound. A stage
that stays silent, or one that runs something else, is refused on every
stage that announced, naming it. Only then do the hand-off rounds run.

Settings that decide collectives run before those rounds (vLLM 0.34.0's
extensible KV cache adds world-group all-reduces to KV cache set-up) travel
with an earlier announcement, and a difference is refused naming the option.
"""

import json
import os
import socket
import time
from collections.abc import Mapping
from itertools import count
from pathlib import Path
from typing import Any

import torch.distributed as dist

import vllm
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger

logger = init_logger(__name__)

# Raised whenever what the stages exchange after the announcement changes.
PROTOCOL = 3
# Seconds a stage waits for the others to announce.
TIMEOUT_ENV = "VLLM_PP_STAGE_ANNOUNCE_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
# Compared as they are: another value on any stage is refused.
COMPARED = ("protocol", "revision", "vllm_version")
CHECK = "run `make status` on that node and `make apply` from the same k3-sppp checkout"

# Every stage announces once per start-up check, in the same order.
_rounds = count()


def series_revision() -> str:
    """The k3-sppp revision ``make status`` prints for the installed tree,
    from the journal apply wrote beside the ``vllm`` package: the installed
    bytes stay independent of it."""
    journal = Path(vllm.__file__).parent.parent / ".k3_sppp" / "journal.json"
    try:
        data = json.loads(journal.read_text())
    except (OSError, ValueError):
        return "unknown"
    if not isinstance(data, dict) or data.get("state") != "applied":
        return "unknown"
    return str(data.get("revision", "unknown"))


def announcement_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError as error:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not in seconds") from error


def this_stage() -> dict[str, Any]:
    return {
        "protocol": PROTOCOL,
        "revision": series_revision(),
        "vllm_version": vllm.__version__,
        "host": socket.gethostname(),
    }


def _store_key(round_: int, stage: int) -> str:
    ranks = "-".join(map(str, get_pp_group().ranks))
    return f"k3-sppp/pp-announce/{ranks}/{round_}/{stage}"


def announce_and_wait(
    timeout: float | None = None, settings: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Announce this stage and return every stage's announcement, or raise
    naming the stages that stayed silent within ``timeout`` seconds, that run
    another protocol, revision or vLLM, or whose ``settings`` (command-line
    option to this stage's value) differ."""
    pp_group = get_pp_group()
    timeout = announcement_timeout() if timeout is None else timeout
    store = dist.distributed_c10d._get_default_store()
    round_ = next(_rounds)
    me = pp_group.rank_in_group
    mine = this_stage() | {"settings": dict(settings or {})}
    store.set(_store_key(round_, me), json.dumps(mine))
    others = [n for n in range(pp_group.world_size) if n != me]
    logger.info(
        "PP stage %d on %s: k3-sppp revision %s, vLLM %s, protocol %d; waiting "
        "up to %.0f s (%s) for stage(s) %s to announce theirs",
        me,
        mine["host"],
        mine["revision"],
        mine["vllm_version"],
        PROTOCOL,
        timeout,
        TIMEOUT_ENV,
        others,
    )
    deadline = time.monotonic() + timeout
    everyone: dict[int, Any] = {me: mine}
    while True:
        for n in others:
            if n not in everyone and store.check([_store_key(round_, n)]):
                everyone[n] = _parse(store.get(_store_key(round_, n)))
        missing = [n for n in others if n not in everyone]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if missing:
        raise RuntimeError(
            f"PP stage(s) {missing} did not announce themselves within "
            f"{timeout:.0f} s ({TIMEOUT_ENV}); host unknown, as nothing came "
            "from it. They run vLLM without the k3-sppp series, another revision "
            f"of it, or did not start: {CHECK}. This stage runs {_describe(mine)}; "
            "announced: "
            + "; ".join(
                f"stage {n} on {a.get('host', '?')}" for n, a in everyone.items()
            )
        )
    stages = [everyone[n] for n in range(pp_group.world_size)]
    problems = [
        f"{key}: "
        + ", ".join(
            f"stage {n} on {a.get('host', '?')}={a.get(key, 'none')}"
            for n, a in enumerate(stages)
        )
        for key in COMPARED
        if any(a.get(key) != mine.get(key) for a in stages)
    ]
    if problems:
        raise RuntimeError(
            "PP stages run different software and would hang or mix rows at "
            f"their first exchange ({'; '.join(problems)}): {CHECK}."
        )
    differing = [
        f"{option}: "
        + ", ".join(
            f"stage {n} on {a.get('host', '?')}={_setting(a, option)}"
            for n, a in enumerate(stages)
        )
        for option, value in mine["settings"].items()
        if any(_setting(a, option) != value for a in stages)
    ]
    if differing:
        raise RuntimeError(
            "PP stages were started with settings that would leave them "
            f"waiting on each other in a collective ({'; '.join(differing)}). "
            "Start every node with the same options."
        )
    return stages


def announce_before_kv_cache(vllm_config: VllmConfig) -> None:
    """Before KV cache set-up, whose world-group collectives run only where
    the extensible KV cache is on: stages that differ on it would wait there
    for good, before the hand-off check could compare them."""
    if get_pp_group().world_size > 1:
        announce_and_wait(
            settings={
                "--enable-extensible-kv-cache": (
                    vllm_config.cache_config.enable_extensible_kv_cache
                )
            }
        )


def _parse(raw: bytes) -> dict[str, Any]:
    """Another protocol's announcement may hold other keys, or not be ours."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"protocol": f"unreadable {raw[:40]!r}"}


def _setting(announcement: dict[str, Any], option: str) -> Any:
    return announcement.get("settings", {}).get(option, "unset")


def _describe(announcement: dict[str, Any]) -> str:
    return (
        f"k3-sppp revision {announcement['revision']}, vLLM "
        f"{announcement['vllm_version']}, protocol {announcement['protocol']}"
    )


__all__ = [
    "PROTOCOL",
    "TIMEOUT_ENV",
    "announce_and_wait",
    "announce_before_kv_cache",
    "series_revision",
]
