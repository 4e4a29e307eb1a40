# SPDX-License-Identifier: Apache-2.0
"""The test bed catches the known failure shapes of SP across PP stages.

Each case injects one bug the way it shows up in practice and checks that
the comparison with the reference, or the run itself, fails clearly.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import mismatches
from tests.sppp_testbed.bases import only_on_0_33
from tests.sppp_testbed.launcher import RankFailure
from tests.sppp_testbed.stages import Scenario, run_step
from tests.sppp_testbed.tiny_k3 import HIDDEN, MAX_NUM_BATCHED_TOKENS
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.models.common.ops.sequence_parallel import sp_shard


def hand_over_sp_shards(num_tokens: int, overrides: dict[str, bool] | None):
    """Stage 0 sends its SP shard of rows 0..N-1; stage 1 returns the row ids
    it received and the ids of its own shard."""
    tp_group, pp_group = get_tp_group(), get_pp_group()
    rows = torch.arange(num_tokens, dtype=torch.float64)[:, None].repeat(1, 4)
    shard = sp_shard(rows)
    if pp_group.is_first_rank:
        for handle in pp_group.isend_tensor_dict(
            {"hidden_states": shard},
            all_gather_group=tp_group,
            all_gather_tensors=overrides,
        ):
            if handle is not None:
                handle.wait()
        return None
    tensors, handles, postprocess = pp_group.irecv_tensor_dict(
        all_gather_group=tp_group, all_gather_tensors=overrides
    )
    for handle in handles:
        handle.wait()
    for step in postprocess:
        step()
    return tensors["hidden_states"][:, 0].tolist(), shard[:, 0].tolist()


@topologies((2, 2))
def test_sp_shards_through_the_replicated_transport_arrive_scrambled(pool):
    """vLLM's default transport assumes TP-replicated tensors: each TP rank
    sends a 1/TP slice and the receiver all-gathers. SP shards differ per
    rank, so TP rank 1 gets rows [0, 1, 6, 7], shaped exactly like its
    shard [4, 5, 6, 7]. Only the per-key override keeps them intact."""
    default = pool.run(hand_over_sp_shards, 8, None)
    assert default[3] == ([0.0, 1.0, 6.0, 7.0], [4.0, 5.0, 6.0, 7.0])
    assert default[2] == ([0.0, 1.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0])
    kept = pool.run(hand_over_sp_shards, 8, {"hidden_states": False})
    assert kept[2] == ([0.0, 1.0, 2.0, 3.0],) * 2
    assert kept[3] == ([4.0, 5.0, 6.0, 7.0],) * 2


@topologies((2, 1))
def test_gather_skipped_by_a_shape_test_is_caught(pool, reference):
    """N=1, TP=2: each rank holds one row either way, so a row-count test
    cannot tell SP shards from replicated rows; rank 1 then returns padding."""
    scenario = Scenario(True, 1)
    assert not mismatches(pool.run(run_step, scenario), reference(scenario), 2)
    faulty = Scenario(True, 1, fault="gather_by_shape")
    problems = mismatches(pool.run(run_step, faulty), reference(faulty), 2)
    assert any(p.startswith("rank 1 hidden_states: max error") for p in problems)


@topologies((2, 1))
def test_pad_rows_leaking_into_outputs_are_caught(pool, reference):
    faulty = Scenario(True, 1, fault="pad_batch_to_tp")
    problems = mismatches(pool.run(run_step, faulty), reference(faulty), 2)
    want = f"rank 0 hidden_states: shape (2, {HIDDEN}), want (1, {HIDDEN})"
    assert want in problems


@topologies((1, 2))
def test_aux_slot_off_by_one_at_a_stage_boundary_fails_with_a_message(pool):
    scenario = Scenario(False, 17, aux_layers=(0, 2, 3), fault="shift_aux_slots")
    with pytest.raises(RankFailure) as failure:
        pool.run(run_step, scenario)
    message = str(failure.value)
    assert "--- rank 1 (TP 0, PP 1) ---" in message
    assert "Missing aux_hidden_states_0 from PP intermediate tensors" in message


@topologies((1, 2))
def test_sender_and_receiver_disagreeing_on_keys_fail_fast(pool):
    pool.run(run_step, Scenario(False, 17))  # a started pool: time the case only
    scenario = Scenario(False, 17, aux_layers=(0, 2, 3), fault="expect_extra_aux_key")
    start = time.monotonic()
    with pytest.raises(RankFailure, match="Missing aux_hidden_states_2"):
        pool.run(run_step, scenario)
    assert time.monotonic() - start < 30, "a key mismatch must not hang"


@topologies((2, 2))
def test_stages_that_padded_the_batch_differently_fail_naming_the_rows(pool):
    """The first stage dispatches N+4 tokens and sends 11-row shards; the
    second dispatches N=17 and expects 9. Every receiving rank refuses."""
    with pytest.raises(RankFailure) as failure:
        pool.run(run_step, Scenario(True, 17, fault="sender_pads_more"))
    message = str(failure.value)
    for rank in (2, 3):
        assert f"--- rank {rank} (TP {rank % 2}, PP 1) ---" in message
    assert (
        message.count(
            "ValueError: Received hidden_states with 11 rows for a batch of N=17 "
            "tokens at TP=2"
        )
        == 2
    ), message


@only_on_0_33("the legacy model runner's buffers (gpu_model_runner.py)")
@topologies((2, 2))
def test_the_runner_refuses_another_stages_padding_before_the_copy(pool):
    """The same mis-padded hand-off through the legacy runner's buffers: the
    runner refuses it before the copy, as it does before a CUDA graph replay,
    where the model's own check never runs."""
    with pytest.raises(RankFailure) as failure:
        pool.run(
            run_step, Scenario(True, 17, fault="sender_pads_more", runner="legacy")
        )
    message = str(failure.value)
    assert (
        message.count(
            "ValueError: Received PP intermediate tensors of 11 rows for a step "
            "of 17 tokens where this stage expects 9"
        )
        == 2
    ), message


@topologies((2, 2))
def test_a_dummy_run_that_is_not_narrowed_fails(pool, reference):
    """A hand-over that skips the row rule on a dummy run hands the model the
    first N rows of full-capacity buffers (the runner before its buffers were
    shard-sized), not the c rows a real step hands: real steps still match,
    the dummy run is refused by the model on both later-stage ranks."""
    for n in (17, 64):
        real = Scenario(True, n, fault="skip_narrowing")
        assert not mismatches(pool.run(run_step, real), reference(real), pool.tp)
        with pytest.raises(RankFailure) as failure:
            pool.run(
                run_step, Scenario(True, n, dummy_run=True, fault="skip_narrowing")
            )
        message = str(failure.value)
        for rank in (2, 3):
            assert f"--- rank {rank} (TP {rank % 2}, PP 1) ---" in message
        assert (
            message.count(
                f"ValueError: Received hidden_states with {n} rows for a batch of "
                f"N={n} tokens at TP=2: a sequence-parallel hand-off has "
                f"ceil(N/TP)={-(-n // 2)} rows"
            )
            == 2
        ), message


@topologies((2, 2))
def test_a_later_stage_that_narrows_twice_fails(pool):
    """Narrowing the shard again (ceil(ceil(N/TP)/TP) rows) leaves attention
    fewer rows than the sequence, in real steps and dummy runs alike."""
    for dummy_run in (False, True):
        scenario = Scenario(
            True, MAX_NUM_BATCHED_TOKENS, fault="narrow_twice", dummy_run=dummy_run
        )
        with pytest.raises(RankFailure, match="attention sees the whole sequence"):
            pool.run(run_step, scenario)
