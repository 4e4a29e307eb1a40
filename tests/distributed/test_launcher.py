# SPDX-License-Identifier: Apache-2.0
"""The rank launcher: layout, results by rank, failures named by rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.sppp_testbed.launcher import RankFailure, RankPool
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.distributed.parallel_state import get_pp_group, get_tp_group


def rank_layout() -> tuple[int, int, int]:
    return dist.get_rank(), get_tp_group().rank_in_group, get_pp_group().rank_in_group


def fail_on_rank(bad_rank: int) -> str:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return "fine"


def gather_without_rank(absent: int) -> None:
    if dist.get_rank() != absent:
        tensor_model_parallel_all_gather(torch.ones(2, 2), 0)


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(tp=2, pp=1)
    yield pool
    pool.close()


def test_results_come_back_in_rank_order_with_vllm_layout(pool):
    assert pool.run(rank_layout) == [(0, 0, 0), (1, 1, 0)]


def test_an_exception_fails_the_case_naming_rank_and_traceback(pool):
    with pytest.raises(RankFailure) as failure:
        pool.run(fail_on_rank, 1)
    message = str(failure.value)
    assert "--- rank 1 (TP 1, PP 0) ---" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "rank 0" not in message
    assert pool.run(rank_layout) == [(0, 0, 0), (1, 1, 0)], "pool restarts"


def test_a_hung_collective_fails_within_the_deadline(pool):
    # Rank 1 answers at once; the deadline is all this test waits.
    with pytest.raises(RankFailure, match=r"no answer from rank\(s\) \[0\] within 4 s"):
        pool.run(gather_without_rank, 1, timeout=4)
    assert pool.run(rank_layout) == [(0, 0, 0), (1, 1, 0)], "pool restarts"
