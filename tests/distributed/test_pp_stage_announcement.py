# SPDX-License-Identifier: Apache-2.0
"""Nodes that run different software fail within a bound, naming the stage,
instead of hanging in the start-up check's collectives: every stage announces
its build through the c10d store (which answers without the peer) before any
PP traffic, as ``Worker.initialize_from_config`` does. Upstream the build is
vLLM's version and commit; with the series applied it carries the series
revision too (``k3_sppp_revision``, the patch set's own seam filler). Real
ranks and the real PP group over gloo; each stage then runs the start-up
check of test_pp_hand_off_agreement."""

from __future__ import annotations

import json
import os
import socket
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
from vllm.v1.worker import k3_sppp_revision, pp_hand_off_agreement
from vllm.v1.worker.pp_hand_off_agreement import TIMEOUT_ENV, announce_pp_stages

# Short enough for the suite, long enough for a loaded machine's ranks to
# reach the check together.
SHORT_BOUND_S = 3.0
SILENT = "did not announce themselves within 3 s"


def start_as(kinds: list[str | tuple]) -> tuple[str | None, float]:
    """Run this stage's start-up as ``kinds[stage]`` says: "patched" (the
    series as installed), "stock" (a release without the check, which
    announces nothing and goes on to its first PP receive), ("build", text)
    for a stage whose build reads otherwise (another revision of the series,
    another vLLM), or ("raw", fields) for a stage whose code we do not run:
    it writes what it announces and goes on. Its error and seconds."""
    kind = kinds[get_pp_group().rank_in_group]
    if kind == "stock" or kind[0] == "raw":
        # This rank's rounds stay aligned with the others' for later tests.
        round_ = next(pp_hand_off_agreement._rounds)
        if kind != "stock":
            ranks = "-".join(map(str, get_pp_group().ranks))
            key = f"pp_stage_announce/{ranks}/{round_}/{get_pp_group().rank_in_group}"
            dist.distributed_c10d._get_default_store().set(key, json.dumps(kind[1]))
        return None, 0.0
    saved_env = os.environ.get(TIMEOUT_ENV)
    saved_build = pp_hand_off_agreement.stage_build
    os.environ[TIMEOUT_ENV] = str(SHORT_BOUND_S)
    if kind[0] == "build":
        pp_hand_off_agreement.stage_build = lambda: kind[1]
    start = time.monotonic()
    try:
        announce_pp_stages({})
        error, _ = start_stage([SP] * get_pp_group().world_size)
    except RuntimeError as refused:
        error = str(refused)
    finally:
        pp_hand_off_agreement.stage_build = saved_build
        if saved_env is None:
            del os.environ[TIMEOUT_ENV]
        else:
            os.environ[TIMEOUT_ENV] = saved_env
    return error, time.monotonic() - start


def run(pool, *kinds: str | tuple) -> list[tuple[str | None, float]]:
    return pool.run(start_as, list(kinds), timeout=BOUND_S)


PATCHED = ("patched",)


@topologies((2, 2))
def test_a_stock_stage_is_refused_within_the_bound_naming_it(pool):
    results = run(pool, PATCHED, "stock")
    for error, seconds in results[: pool.tp]:
        assert error is not None and SILENT in error, error
        assert "PP stage(s) [1]" in error, error
        assert TIMEOUT_ENV in error and "make status" in error, error
        assert pp_hand_off_agreement.stage_build() in error, error
        assert SHORT_BOUND_S <= seconds < SHORT_BOUND_S + 6, seconds


def test_a_stage_on_the_pristine_tree_is_refused_within_the_bound(pristine_vllm):
    """Stage 1 imports the installed vLLM release as it was before the
    series."""
    mixed = RankPool(1, 2, preload=PRELOAD, stage_vllm_roots={1: pristine_vllm})
    try:
        (error, seconds), pristine = mixed.run(
            start_as_node, [PATCHED, "pristine"], timeout=BOUND_S
        )
    finally:
        mixed.close()
    assert pristine == (None, 0.0)
    assert error is not None and SILENT in error and "PP stage(s) [1]" in error
    assert SHORT_BOUND_S <= seconds < SHORT_BOUND_S + 6, seconds


@topologies((2, 2))
def test_a_stock_first_stage_is_named_by_the_last(pool):
    results = run(pool, "stock", PATCHED)
    for error, _ in results[pool.tp :]:
        assert error is not None and "PP stage(s) [0]" in error, error


@topologies((2, 2))
def test_another_revision_is_refused_on_every_stage_naming_both(pool):
    other = "vLLM 0.34.0, k3-sppp revision 0123456789ab"
    results = run(pool, PATCHED, ("build", other))
    for error, _ in results:
        assert error is not None and "run different builds" in error, error
        assert f"stage 1 on {socket.gethostname()}={other}" in error, error
        assert k3_sppp_revision.series_revision() in error, error


@topologies((2, 2))
def test_an_announcement_without_our_keys_is_a_message_not_a_key_error(pool):
    for raw in ({"protocol": 1}, [1, 2]):
        results = run(pool, ("raw", raw), PATCHED)
        for error, _ in results[pool.tp :]:
            assert error is not None and "build: stage 0" in error, error
            assert "KeyError" not in error, error


@topologies((2, 2))
def test_same_revision_starts_as_before(pool):
    results = run(pool, PATCHED, PATCHED)
    assert [error for error, _ in results] == [None] * len(results), results


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
    host = socket.gethostname()
    for error in results:
        assert error == (
            "PP stages run different builds or settings and would wait on each "
            "other in a collective (enable_extensible_kv_cache: stage 0 "
            f"on {host}=True, stage 1 on {host}=False). Start every node with the "
            "same vLLM and options."
        ), error
    # Alike, every stage goes on to set its KV cache up.
    for extensible in (True, False):
        results = pool.run(initialize_kv_cache, [extensible] * 2, timeout=BOUND_S)
        assert results == ["reached KV cache set-up"] * pool.world, results
