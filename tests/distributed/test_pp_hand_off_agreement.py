# SPDX-License-Identifier: Apache-2.0
"""PP stages started with different flags are refused at start-up on every
stage, showing each stage's values and the options to align, instead of
hanging or mixing rows at the first hand-off. Real ranks, the real PP group
over gloo, and per stage the tiny Kimi K3 built from that stage's own config,
as a headless node builds it from its own command line."""

from __future__ import annotations

import dataclasses

import torch

from tests.distributed.conftest import topologies
from tests.sppp_testbed.tiny_k3 import build_model, scenario_config, stand_ins
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.v1.worker.pp_hand_off_agreement import check_pp_hand_off_agreement

# A start-up check answers at once: far inside the pool's bound on a hang.
BOUND_S = 30.0


@dataclasses.dataclass(frozen=True)
class StageFlags:
    """What one node's command line sets, as far as the hand-off goes."""

    moe_backend: str = "deep_gemm_mega_moe"
    aux_layers: tuple[int, ...] = (0, 2, 3)
    enforce_eager: bool = False
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    cudagraph_mode: str = "FULL_DECODE_ONLY"


PRODUCTION = StageFlags()


def start_stage(flags_by_stage: list[StageFlags]) -> str | None:
    """Build this stage's model from its flags and run the start-up check;
    its error, if any."""
    flags = flags_by_stage[get_pp_group().rank_in_group]
    config = scenario_config(
        get_tp_group().world_size, get_pp_group().world_size, sp=True
    )
    config.kernel_config.moe_backend = flags.moe_backend
    config.model_config.enforce_eager = flags.enforce_eager
    config.compilation_config.cudagraph_capture_sizes = list(flags.capture_sizes)
    config.compilation_config.cudagraph_mode = CUDAGraphMode[flags.cudagraph_mode]
    with set_current_vllm_config(config), stand_ins(), torch.no_grad():
        model = build_model(config)
        model._set_aux_hidden_state_layers(flags.aux_layers)
        try:
            check_pp_hand_off_agreement(config, model)
        except RuntimeError as error:
            return str(error)
    return None


def assert_refused_everywhere(errors: list[str | None], *parts: str) -> None:
    assert all(errors), errors
    for error in errors:
        assert "disagree on their hand-off and would hang or mix rows" in error
        for part in parts:
            assert part in error, (part, error)


@topologies((2, 2))
def test_stages_that_agree_start(pool):
    flags = [PRODUCTION, dataclasses.replace(PRODUCTION)]
    assert pool.run(start_stage, flags, timeout=BOUND_S) == [None] * pool.world


@topologies((2, 2))
def test_a_stage_with_another_moe_backend_fails_on_every_rank(pool):
    other = dataclasses.replace(PRODUCTION, moe_backend="auto")
    errors = pool.run(start_stage, [PRODUCTION, other], timeout=BOUND_S)
    assert_refused_everywhere(
        errors,
        "moe_backend: stage 0=deep_gemm_mega_moe, stage 1=auto",
        "sequence_parallel: stage 0=True, stage 1=False",
        "all_gather_tensors: stage 0={'hidden_states': False, 'residual': False}, "
        "stage 1={}",
        "Start every node with the same --kernel-config, "
        "--enable-expert-parallel, --tensor-parallel-size.",
    )


@topologies((2, 2))
def test_a_stage_with_other_aux_layers_fails_on_every_rank(pool):
    """Stage 0 captures taps 0 and 2 and sends two slots; a stage 1 started
    with taps (0, 3) expects one."""
    other = dataclasses.replace(PRODUCTION, aux_layers=(0, 3))
    errors = pool.run(start_stage, [PRODUCTION, other], timeout=BOUND_S)
    assert_refused_everywhere(
        errors,
        "aux_hidden_state_slots: stage 0 sends 2, stage 1 expects 1",
        "aux_hidden_state_layers: stage 0=(0, 2, 3), stage 1=(0, 3)",
        "--speculative-config (eagle_aux_hidden_state_layer_ids), "
        "VLLM_PP_LAYER_PARTITION.",
    )
    for error in errors:
        assert "moe_backend" not in error and "cudagraph" not in error, error


@topologies((2, 2))
def test_aux_layers_set_on_the_last_stage_only_start(pool):
    """The legacy runner sets aux layers on the last stage only; with every
    tap on that stage nothing crosses the boundary, as in 0.33.0."""
    first = dataclasses.replace(PRODUCTION, aux_layers=())
    last = dataclasses.replace(PRODUCTION, aux_layers=(3,))
    assert pool.run(start_stage, [first, last], timeout=BOUND_S) == [None] * pool.world


@topologies((2, 2))
def test_a_stage_with_another_backend_but_no_sp_anywhere_starts(pool):
    """The MoE backend alone is not part of the hand-off: without SP on any
    stage, each stage's EP group may run its own backend."""
    flags = [
        dataclasses.replace(PRODUCTION, moe_backend="auto"),
        dataclasses.replace(PRODUCTION, moe_backend="flashinfer_cutlass"),
    ]
    assert pool.run(start_stage, flags, timeout=BOUND_S) == [None] * pool.world


@topologies((2, 2))
def test_stages_with_other_cuda_graph_settings_fail_on_every_rank(pool):
    sizes = dataclasses.replace(PRODUCTION, capture_sizes=(1, 2, 4))
    errors = pool.run(start_stage, [PRODUCTION, sizes], timeout=BOUND_S)
    assert_refused_everywhere(
        errors,
        "cudagraph_capture_sizes: stage 0=[1, 2, 4, 8], stage 1=[1, 2, 4]",
        "--max-cudagraph-capture-size, --compilation-config.",
    )
    eager = dataclasses.replace(PRODUCTION, enforce_eager=True)
    errors = pool.run(start_stage, [PRODUCTION, eager], timeout=BOUND_S)
    assert_refused_everywhere(
        errors, "enforce_eager: stage 0=False, stage 1=True", "--enforce-eager."
    )
    # Equal flags can resolve to other modes: the message says so.
    piecewise = dataclasses.replace(PRODUCTION, cudagraph_mode="PIECEWISE")
    errors = pool.run(start_stage, [PRODUCTION, piecewise], timeout=BOUND_S)
    assert_refused_everywhere(
        errors,
        "cudagraph_mode: stage 0=FULL_DECODE_ONLY, stage 1=PIECEWISE",
        "a stage's attention backends or drafter lowered the mode it resolved "
        "to: set a cudagraph_mode every stage supports.",
    )
