# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline stages must agree on what their hand-offs depend on.

Each stage builds its own ``VllmConfig`` from its own command line (a headless
node is started by hand), and vLLM compares parallel settings across nodes
only for data parallelism. Stages that disagree on the transport of a key, on
the aux states that cross a boundary, on the warm-up steps they run, or on
how many rows a batch's hand-off holds post transfers of other shapes than
their neighbours: NCCL then hangs, mixes rows, or the runner fails at the
first step. Before the first hand-off every stage gathers what the others
would send and expect; what would break raises on every stage, showing each
stage's values and the options behind them. Any other difference is logged on
every stage and changes nothing: a model that keeps no stage output sequence
parallel starts wherever it started before.
"""

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import (
    EagleModelMixin,
    get_pp_num_rows,
)
from vllm.v1.worker.pp_hand_off_runner import (
    RUNNER_OPTIONS,
    RunnerPadding,
    runner_settings,
)
from vllm.v1.worker.pp_hand_off_shapes import (
    BatchShape,
    aux_hidden_state_layers,
    batch_shapes,
)
from vllm.v1.worker.pp_intermediate_tensors import accepts_hand_off
from vllm.v1.worker.pp_stage_announcement import announce_and_wait

logger = init_logger(__name__)

# The command-line options behind each value, named in the error (the
# runner's settings: RUNNER_OPTIONS).
OPTIONS: dict[str, tuple[str, ...]] = {
    "sequence_parallel": (
        "--kernel-config",
        "--enable-expert-parallel",
        "--tensor-parallel-size",
    ),
    "all_gather_tensors": (
        "--kernel-config",
        "--enable-expert-parallel",
        "--tensor-parallel-size",
    ),
    "aux_hidden_state_slots": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
        "VLLM_PP_LAYER_PARTITION",
    ),
    "batch_padding": (
        "--compilation-config",
        "--max-cudagraph-capture-size",
        "--enforce-eager",
        "--speculative-config (num_speculative_tokens)",
    ),
    "cudagraph_mode": ("--compilation-config",),
    "cudagraph_capture_sizes": (
        "--max-cudagraph-capture-size",
        "--compilation-config",
    ),
    "enforce_eager": ("--enforce-eager",),
    "max_num_seqs": ("--max-num-seqs",),
    "max_num_batched_tokens": ("--max-num-batched-tokens",),
    "moe_backend": ("--kernel-config",),
    "enable_expert_parallel": ("--enable-expert-parallel",),
    "aux_hidden_state_layers": (
        "--speculative-config (eagle_aux_hidden_state_layer_ids)",
    ),
    **RUNNER_OPTIONS,
}


# Compared as they are: a difference breaks the hand-off.
REFUSED = ("sequence_parallel", "all_gather_tensors")

# Shown where they differ, never refused on their own: the hand-off depends on
# them only through the rows each stage pads a batch to, which is compared
# itself ("batch_padding"), or through the aux slots, compared per boundary;
# each stage's EP group is its own.
SHOWN = (
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "enforce_eager",
    "max_num_seqs",
    "max_num_batched_tokens",
    "moe_backend",
    "enable_expert_parallel",
    "aux_hidden_state_layers",
)


# Equal flags can pad alike or not: a stage's attention backends, or the
# drafter on the last stage, may lower the CUDA graph mode it resolves.
CUDAGRAPH_MODE_HINT = (
    " If the flags already match, a stage's attention backends or drafter "
    "lowered the CUDA graph mode it resolved: set a cudagraph_mode every "
    "stage supports."
)


def pp_hand_off_settings(
    vllm_config: VllmConfig,
    model: nn.Module,
    padding: RunnerPadding,
    all_gather_tensors: dict[str, bool] | None,
) -> dict[str, Any]:
    """What decides the shapes and the transport of this stage's hand-offs;
    ``all_gather_tensors`` is what the worker passes to every PP send and
    receive."""
    pp_group = get_pp_group()
    overrides = all_gather_tensors or {}
    layers, start, end = aux_hidden_state_layers(model)
    aux_key = EagleModelMixin.AUX_HIDDEN_STATE_KEY
    # A stage relays every aux state captured up to its last boundary and
    # expects those captured up to its first.
    received = 0 if pp_group.is_first_rank else bisect_right(layers, start)
    sent = 0 if pp_group.is_last_rank else bisect_right(layers, end)
    # A model keeps stage outputs sequence parallel exactly when it declares
    # keys that are TP shards, not replicas.
    sequence_parallel = any(not gather for gather in overrides.values())
    crossing = (f"{aux_key}{slot}" for slot in range(max(received, sent)))
    return {
        "sequence_parallel": sequence_parallel,
        # Aux slots are compared per boundary, below.
        "all_gather_tensors": {
            key: gather
            for key, gather in overrides.items()
            if not key.startswith(aux_key)
        },
        "aux_slots_received": received,
        "aux_slots_sent": sent,
        # Under SP an aux state is a shard like the hidden states; the
        # transport's default would send a 1/TP slice of it and all-gather.
        "aux_keys_replicated": [
            key for key in crossing if sequence_parallel and overrides.get(key, True)
        ],
        "batch_shapes": padding.bounds,
        "cudagraph_mode": str(padding.cudagraph_mode),
        "cudagraph_capture_sizes": list(
            vllm_config.compilation_config.cudagraph_capture_sizes or ()
        ),
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "moe_backend": vllm_config.kernel_config.moe_backend,
        "enable_expert_parallel": vllm_config.parallel_config.enable_expert_parallel,
        **runner_settings(vllm_config, padding, layers),
    }


def hand_off_rows(
    model: nn.Module, padding: RunnerPadding, shapes: list[BatchShape]
) -> list[tuple[int, int | None]]:
    """Per batch: the tokens this stage dispatches, and the rows the model
    declares for them (``None``: replicas of every dispatched row)."""
    declared: dict[int, int | None] = {}
    rows = []
    for shape in shapes:
        num_tokens = padding.padded_num_tokens(shape)
        if num_tokens not in declared:
            declared[num_tokens] = get_pp_num_rows(model, num_tokens)
        rows.append((num_tokens, declared[num_tokens]))
    return rows


@dataclass(frozen=True)
class StageError:
    """A stage that could not compute its part, sent in its place."""

    message: str


Answer = TypeVar("Answer")


class StagesCouldNotAnswer(RuntimeError):
    """Some stage could not compute its part; every stage raises it."""


def gather_from_stages(compute: Callable[[], Answer]) -> list[Answer]:
    """Every stage's answer. A stage whose own computation raises sends its
    error instead, so every stage raises at once, none waits on the rest."""
    pp_group = get_pp_group()
    failure: Exception | None = None
    try:
        mine: Answer | StageError = compute()
    except Exception as error:  # sent to the other stages, then raised
        failure = error
        mine = StageError(f"{type(error).__name__}: {error}")
    everyone: list[Any] = [None] * pp_group.world_size
    dist.all_gather_object(everyone, mine, group=pp_group.cpu_group)
    failed = [(n, a) for n, a in enumerate(everyone) if isinstance(a, StageError)]
    if failed:
        raise StagesCouldNotAnswer(
            "Pipeline stages could not compare their hand-off settings: "
            + "; ".join(f"stage {n}: {answer.message}" for n, answer in failed)
        ) from failure
    return everyone


def differences(everyone: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    return [
        f"{key}: " + ", ".join(f"stage {n}={s[key]}" for n, s in enumerate(everyone))
        for key in keys
        if any(s[key] != everyone[0][key] for s in everyone)
    ]


def aux_slot_problems(everyone: list[dict[str, Any]]) -> list[str]:
    problems = []
    for stage in range(len(everyone) - 1):
        sent = everyone[stage]["aux_slots_sent"]
        expected = everyone[stage + 1]["aux_slots_received"]
        if sent != expected:
            problems.append(
                f"aux_hidden_state_slots: stage {stage} sends {sent}, "
                f"stage {stage + 1} expects {expected}"
            )
    return problems


def aux_transport_problem(everyone: list[dict[str, Any]]) -> str | None:
    """Sequence-parallel stages whose transport would take an aux state that
    crosses a boundary for a TP replica: every rank would receive the same
    rows, stitched from each rank's slice of its own shard."""
    replicated = [
        f"stage {n}: {', '.join(s['aux_keys_replicated'])}"
        for n, s in enumerate(everyone)
        if s["aux_keys_replicated"]
    ]
    if not replicated:
        return None
    return (
        "Pipeline stages would hand aux hidden states over scrambled: "
        f"{'; '.join(replicated)} cross a stage boundary as TP replicas (a 1/TP "
        "slice per rank, all-gathered on the receiver) while the hidden states "
        "are sequence-parallel shards. The model's "
        "get_pp_intermediate_tensor_all_gather_overrides() must map each aux "
        "key that crosses a stage to False, and be asked after the aux layers "
        "are set."
    )


def warm_up_problems(everyone: list[dict[str, Any]]) -> list[str]:
    """Warm-up steps that differ, shown by what decides them."""
    steps = [s["warm_up_steps"] for s in everyone]
    if all(step == steps[0] for step in steps):
        return []
    sizing = any(step and "kv_cache_sizing" in step for step in steps)
    keys = ("warm_up", "kv_cache_sizing") if sizing else ("warm_up",)
    return differences(everyone, keys) or differences(everyone, ("warm_up_steps",))


def padding_problem(
    shapes: list[BatchShape], rows: list[list[tuple[int, int | None]]]
) -> str | None:
    """The first batch one stage hands on in rows the next refuses: the
    runner's own rule (``accepts_hand_off``), for every batch it dispatches."""
    for i, shape in enumerate(shapes):
        for stage in range(len(rows) - 1):
            sent_tokens, declared = rows[stage][i]
            sent = sent_tokens if declared is None else declared
            num_tokens, expected = rows[stage + 1][i]
            if not accepts_hand_off(sent, num_tokens, expected):
                wants = f"at least {num_tokens}" if expected is None else expected
                return (
                    f"batch_padding: {shape} is dispatched as {sent_tokens} "
                    f"tokens on stage {stage}, which sends {sent} rows, and as "
                    f"{num_tokens} on stage {stage + 1}, which expects {wants}"
                )
    return None


def check_pp_hand_off_agreement(
    vllm_config: VllmConfig,
    model: nn.Module,
    model_runner: object,
    all_gather_tensors: dict[str, bool] | None,
) -> None:
    """Raise on every stage unless all PP stages would hand off alike; log
    the differences that cannot break a hand-off. ``all_gather_tensors`` is
    what the worker passes to every PP send and receive."""
    if get_pp_group().world_size == 1:
        return
    # A silent or foreign stage would leave the rounds below waiting.
    announce_and_wait()
    paddings: list[RunnerPadding] = []

    def settings() -> dict[str, Any]:
        paddings.append(RunnerPadding(vllm_config, model_runner))
        return pp_hand_off_settings(vllm_config, model, paddings[0], all_gather_tensors)

    everyone = gather_from_stages(settings)
    if scrambled := aux_transport_problem(everyone):
        raise RuntimeError(scrambled)
    shapes = batch_shapes([s["batch_shapes"] for s in everyone])
    sequence_parallel = any(s["sequence_parallel"] for s in everyone)
    try:
        rows = gather_from_stages(lambda: hand_off_rows(model, paddings[0], shapes))
    except StagesCouldNotAnswer as error:
        if sequence_parallel:
            raise
        # Without SP a runner whose padding cannot be asked (an out-of-tree
        # graph manager) starts as it did before, when nothing was compared.
        logger.warning("%s; batch padding not compared.", error)
        rows = None

    problems = differences(everyone, REFUSED) + aux_slot_problems(everyone)
    problems += warm_up_problems(everyone)
    if not problems and rows and (problem := padding_problem(shapes, rows)):
        problems.append(problem)
    shown = differences(everyone, SHOWN)
    if not problems:
        if shown:
            logger.warning(
                "Pipeline stages differ in %s; their hand-offs still agree.",
                "; ".join(shown),
            )
        return
    keys = [text.split(":", 1)[0] for text in problems + shown]
    options = ", ".join(dict.fromkeys(name for key in keys for name in OPTIONS[key]))
    hint = CUDAGRAPH_MODE_HINT if "batch_padding" in keys else ""
    raise RuntimeError(
        "Pipeline stages disagree on their hand-off and would hang or mix rows "
        f"at the first one ({'; '.join(problems + shown)}). Start every node "
        f"with the same {options}.{hint}"
    )
