# SPDX-License-Identifier: Apache-2.0
"""Nodes that run different software fail within a bound, naming the stage,
instead of hanging in the start-up check's collectives: every stage announces
itself through the c10d store (which answers without the peer) before any PP
traffic. Real ranks and the real PP group over gloo; each stage runs the full
start-up check of test_pp_hand_off_agreement."""

from __future__ import annotations

import json
import logging
import os
import time
import types

import torch.distributed as dist

from tests.distributed.conftest import PRELOAD, topologies
from tests.distributed.test_pp_hand_off_agreement import BOUND_S, SP, start_stage
from tests.sppp_testbed.bases import only_from_0_34
from tests.sppp_testbed.launcher import RankPool
from tests.sppp_testbed.pristine import start_as_node
from tests.sppp_testbed.tiny_k3 import scenario_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.v1.worker import pp_stage_announcement
from vllm.v1.worker.pp_stage_announcement import TIMEOUT_ENV

# Short enough for the suite, long enough for a loaded machine's ranks to
# reach the check together.
SHORT_BOUND_S = 3.0
SILENT = "did not announce themselves within 3 s"


def start_as(kinds: list[str | dict | tuple]) -> tuple[str | None, float]:
    """Run this stage's start-up as ``kinds[stage]`` says: "patched" (the
    series as installed), "stock" (0.33.0's start-up, which announces
    nothing and goes on to its first PP receive), or a dict of announcement
    fields another revision of the series sends, or ("older", fields) for
    a stage whose own code we do not run: it writes what it announces and goes
    on. Its error and seconds."""
    kind = kinds[get_pp_group().rank_in_group]
    if kind == "stock":
        # Keep this rank's rounds aligned with the others for later tests.
        next(pp_stage_announcement._rounds)
        return None, 0.0
    if isinstance(kind, tuple):
        round_ = next(pp_stage_announcement._rounds)
        key = pp_stage_announcement._store_key(round_, get_pp_group().rank_in_group)
        dist.distributed_c10d._get_default_store().set(key, json.dumps(kind[1]))
        return None, 0.0
    saved_env = os.environ.get(TIMEOUT_ENV)
    saved_stage = pp_stage_announcement.this_stage
    os.environ[TIMEOUT_ENV] = str(SHORT_BOUND_S)
    if isinstance(kind, dict):
        pp_stage_announcement.this_stage = lambda: kind
    start = time.monotonic()
    try:
        error, _ = start_stage([SP] * get_pp_group().world_size)
    finally:
        pp_stage_announcement.this_stage = saved_stage
        if saved_env is None:
            del os.environ[TIMEOUT_ENV]
        else:
            os.environ[TIMEOUT_ENV] = saved_env
    return error, time.monotonic() - start


def run(pool, *kinds: str | dict | tuple) -> list[tuple[str | None, float]]:
    return pool.run(start_as, list(kinds), timeout=BOUND_S)


@topologies((2, 2))
def test_a_stock_stage_is_refused_within_the_bound_naming_it(pool):
    results = run(pool, "patched", "stock")
    patched = results[: pool.tp]
    for error, seconds in patched:
        assert error is not None and SILENT in error, error
        assert "PP stage(s) [1]" in error, error
        assert TIMEOUT_ENV in error and "make status" in error, error
        assert SHORT_BOUND_S <= seconds < SHORT_BOUND_S + 6, seconds
        mine = pp_stage_announcement.this_stage()
        assert (
            f"This stage runs k3-sppp revision {mine['revision']}, vLLM "
            f"{mine['vllm_version']}, protocol {mine['protocol']}; "
            f"announced: stage 0 on {mine['host']}" in error
        ), error


def test_a_stage_on_the_pristine_tree_is_refused_within_the_bound(pristine_vllm):
    """Stage 1 imports the installed vLLM release as it was before the
    series."""
    mixed = RankPool(1, 2, preload=PRELOAD, stage_vllm_roots={1: pristine_vllm})
    try:
        (error, seconds), pristine = mixed.run(
            start_as_node, ["patched", "pristine"], timeout=BOUND_S
        )
    finally:
        mixed.close()
    assert pristine == (None, 0.0)
    assert error is not None and SILENT in error and "PP stage(s) [1]" in error
    assert SHORT_BOUND_S <= seconds < SHORT_BOUND_S + 6, seconds


@topologies((2, 2))
def test_a_stock_first_stage_is_named_by_the_last(pool):
    results = run(pool, "stock", "patched")
    for error, _ in results[pool.tp :]:
        assert error is not None and "PP stage(s) [0]" in error, error


@topologies((2, 2))
def test_another_revision_is_refused_on_every_stage_naming_both(pool):
    other = pp_stage_announcement.this_stage() | {"revision": "0123456789ab"}
    results = run(pool, "patched", other)
    for error, _ in results:
        assert error is not None and "run different software" in error, error
        assert "0123456789ab" in error, error
        assert pp_stage_announcement.series_revision() in error, error


@topologies((2, 2))
def test_an_older_protocol_without_our_keys_is_a_message_not_a_key_error(pool):
    results = run(pool, ("older", {"protocol": 1}), "patched")
    for error, _ in results[pool.tp :]:
        assert error is not None and "protocol: stage 0" in error, error
        assert "revision: stage 0" in error and "=none" in error, error
        assert "KeyError" not in error, error


@topologies((2, 2))
def test_same_revision_starts_as_before(pool):
    results = run(pool, "patched", "patched")
    assert [error for error, _ in results] == [None] * len(results), results


def announce_logging() -> tuple[list[dict], list[str]]:
    """Every stage's announcement as this stage received them, and what it
    logged meanwhile."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = pp_stage_announcement.logger
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        stages = pp_stage_announcement.announce_and_wait(timeout=BOUND_S)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return stages, records


@topologies((2, 2))
def test_each_stage_logs_what_it_runs_and_whom_it_waits_for(pool):
    """What a node's log shows while it waits on the others: its stage,
    host, revision and vLLM, the bound and where to set it; then every
    stage's announcement, in stage order."""
    # No settings asked for: the hand-off check announces none.
    mine = pp_stage_announcement.this_stage() | {"settings": {}}
    for rank, (stages, lines) in enumerate(pool.run(announce_logging, timeout=BOUND_S)):
        assert stages == [mine, mine], stages
        stage = rank // pool.tp
        assert lines == [
            f"PP stage {stage} on {mine['host']}: k3-sppp revision "
            f"{mine['revision']}, vLLM {mine['vllm_version']}, protocol "
            f"{mine['protocol']}; waiting up to {BOUND_S:.0f} s ({TIMEOUT_ENV}) "
            f"for stage(s) [{1 - stage}] to announce theirs"
        ], lines


class KVCacheSetUpReached(Exception):
    """Planted where vLLM's KV cache set-up reads its config first."""


class PlantedKVCacheConfig:
    @property
    def num_blocks(self) -> int:
        raise KVCacheSetUpReached


def initialize_kv_cache(extensible_by_stage: list[bool]) -> str:
    """This stage's ``Worker.initialize_from_config`` as 0.34.0's executor
    calls it once every worker has profiled: with the extensible KV cache on,
    its set-up runs a world-group all-reduce a stage without it never joins.
    What it raised: the announcement's refusal, or the planted end of the
    announcement's part."""
    from vllm.v1.worker.gpu_worker import Worker

    config = scenario_config(
        get_tp_group().world_size, get_pp_group().world_size, sp=True
    )
    stage = get_pp_group().rank_in_group
    config.cache_config.enable_extensible_kv_cache = extensible_by_stage[stage]
    worker = types.SimpleNamespace(vllm_config=config, cache_config=config.cache_config)
    saved = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = str(SHORT_BOUND_S)
    try:
        Worker.initialize_from_config(worker, PlantedKVCacheConfig())
    except KVCacheSetUpReached:
        return "reached KV cache set-up"
    except RuntimeError as error:
        return str(error)
    finally:
        if saved is None:
            del os.environ[TIMEOUT_ENV]
        else:
            os.environ[TIMEOUT_ENV] = saved
    return "returned"


@only_from_0_34("the extensible KV cache's collectives in initialize_from_config")
@topologies((2, 2))
def test_stages_that_differ_on_the_extensible_kv_cache_fail_before_its_collective(
    pool,
):
    """vLLM 0.34.0 sizes an extensible KV cache with a world-group all-reduce
    in ``initialize_from_config`` (gpu_worker.py ``_min_across_ranks``), long
    before the hand-off check: a node started without it would leave the
    others there for good. The stages' announcement opens the call and
    refuses on every stage, naming the option and each stage's value."""
    results = pool.run(initialize_kv_cache, [True, False], timeout=BOUND_S)
    host = pp_stage_announcement.this_stage()["host"]
    for error in results:
        assert error == (
            "PP stages were started with settings that would leave them waiting "
            "on each other in a collective (--enable-extensible-kv-cache: stage 0 "
            f"on {host}=True, stage 1 on {host}=False). Start every node with the "
            "same options."
        ), error
    # Alike, every stage goes on to set its KV cache up.
    for extensible in (True, False):
        results = pool.run(initialize_kv_cache, [extensible] * 2, timeout=BOUND_S)
        assert results == ["reached KV cache set-up"] * pool.world, results
