# SPDX-License-Identifier: Apache-2.0
"""The class a user's checkpoint loads, started by vLLM's worker and V2 runner.

A tiny Kimi K3 checkpoint directory (``tests/sppp_testbed/k3_checkpoint.py``)
is served as ``vllm serve`` would start it: vLLM's loader builds
``KimiK3ForConditionalGeneration`` from its ``config.json`` through the model
registry, vLLM's V2 runner loads it with an EAGLE-3 drafter (taps inside
stage 0 and at its boundary; K3's MTP layer or its DSpark drafter in the
drafters' tests), and vLLM's worker takes the transport
overrides that every PP send and receive uses
(``tests/sppp_testbed/loaded_stages.py``). Only what lies below the model
class is stood in. Under SP each aux state that crosses a boundary must go
from TP rank r of one stage to TP rank r of the next as it is (contract 4),
whatever order the runner sets things up in (contract 10).
"""

from __future__ import annotations

import pytest
import torch

from tests.sppp_testbed import k3_checkpoint
from tests.sppp_testbed.loaded_stages import (
    MTP,
    LoadedStageResult,
    dspark,
    eagle3,
    run_loaded_step,
)

TOLERANCE = 1e-12
# Replicated, the MTP block ends in vLLM's fused add-RMSNorm, which adds in
# float32; under SP it adds in the model's dtype: float32 rounding.
MTP_TOLERANCE = 1e-5
NUM_TOKENS = 17
PRELOAD = ("tests.sppp_testbed.loaded_stages",)
# The class both architecture names load.
K3 = "KimiK3ForConditionalGeneration"
# A K3 checkpoint with AttnRes on (its text model mixes earlier blocks'
# outputs into each layer's input).
ATTN_RES = "K3 with AttnRes"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A K3 checkpoint directory per architecture name a user's checkpoint
    carries (K3, K3.1), one with AttnRes on (``ATTN_RES``), and an EAGLE-3
    draft directory (``"draft"``) and a DSpark one (``"dspark"``)."""
    root = tmp_path_factory.mktemp("k3-checkpoints")
    paths = {
        name: str(k3_checkpoint.write_checkpoint(root / name, name))
        for name in k3_checkpoint.ARCHITECTURES
    }
    paths[ATTN_RES] = str(
        k3_checkpoint.write_checkpoint(root / ATTN_RES, K3, attn_res=True)
    )
    paths["draft"] = str(k3_checkpoint.write_eagle3_draft(root / "eagle3"))
    paths["dspark"] = str(k3_checkpoint.write_dspark_draft(root / "tiny-k3-dspark"))
    return paths


@pytest.fixture(scope="module")
def loaded_step(pools, checkpoints):
    """One SP step of ``architecture``'s checkpoint, with ``drafter``
    (EAGLE-3, K3's MTP layer or K3's DSpark), on TP×PP ranks of their
    own (vLLM's CPU worker module, which they import, patches torch's CUDA
    entry points process-wide); memoised."""
    results: dict[tuple[str, int, int, str], list[LoadedStageResult]] = {}

    def run(
        architecture: str, tp: int, pp: int, drafter: str = "eagle3"
    ) -> list[LoadedStageResult]:
        key = (architecture, tp, pp, drafter)
        if key not in results:
            speculative = {
                "eagle3": eagle3(checkpoints["draft"]),
                "mtp": MTP,
                "dspark": dspark(checkpoints["dspark"]),
            }[drafter]
            results[key] = pools(tp, pp, preload=PRELOAD).run(
                run_loaded_step,
                checkpoints[architecture],
                speculative,
                tp > 1,
                NUM_TOKENS,
            )
        return results[key]

    return run


def test_every_aux_state_that_crosses_a_stage_is_declared_shard_to_shard(
    loaded_step,
):
    """The worker's overrides, taken after the runner's load_model set
    EAGLE-3's aux layers, declare each aux key that crosses stage 0's
    boundary shard-to-shard (False), and the aux states TP rank r of stage
    1 receives are the shards TP rank r of stage 0 sent."""
    results = loaded_step(K3, 2, 2)
    problems = []
    for rank, result in enumerate(results):
        if result.architecture != K3:
            problems.append(f"rank {rank} loaded {result.architecture}")
        if rank < 2 and result.vision_tower != "MoonViT3dPretrainedModel":
            problems.append(f"rank {rank}'s vision tower: {result.vision_tower}")
        if not result.sequence_parallel:
            problems.append(f"rank {rank}: no SP")
    crossing = sorted(k for k in results[0].sent if k.startswith("aux_hidden_states_"))
    if not crossing:
        problems.append(f"stage 0 sends no aux state: {sorted(results[0].sent)}")
    for rank, result in enumerate(results):
        overrides = result.worker_overrides or {}
        undeclared = [k for k in crossing if overrides.get(k) is not False]
        if undeclared:
            problems.append(
                f"rank {rank}: the worker's transport overrides {overrides} "
                f"do not declare {undeclared} shard-to-shard"
            )
    for tp_rank in range(2):
        sent, received = results[tp_rank].sent, results[2 + tp_rank].received
        for key in crossing:
            got, want = received.get(key), sent[key]
            if got is None:
                problems.append(f"TP rank {tp_rank}: {key} not received")
            elif got.shape != want.shape:
                problems.append(
                    f"TP rank {tp_rank}: {key} received with shape "
                    f"{tuple(got.shape)}, sent {tuple(want.shape)}"
                )
            elif not torch.equal(got, want):
                error = (got - want).abs().max().item()
                problems.append(
                    f"TP rank {tp_rank}: {key} received differs from the "
                    f"shard sent by {error:.3g}"
                )
    assert not problems, "\n".join(problems)


def parity_problems(
    expected: LoadedStageResult, last_stage: list[LoadedStageResult], first_rank: int
) -> list[str]:
    """Where the last stage's gathered hidden states and EAGLE-3 aux states
    differ from the one-rank reference's."""
    problems = []
    if len(expected.aux_hidden_states or []) != len(k3_checkpoint.EAGLE3_AUX_LAYERS):
        problems.append(f"the reference has {expected.aux_hidden_states} aux states")
    for rank, result in enumerate(last_stage, start=first_rank):
        got_aux = result.aux_hidden_states or []
        pairs = [("hidden_states", result.hidden_states, expected.hidden_states)]
        pairs += [
            (f"aux[{slot}]", got, want)
            for slot, (got, want) in enumerate(
                zip(got_aux, expected.aux_hidden_states or [], strict=False)
            )
        ]
        if len(got_aux) != len(expected.aux_hidden_states or []):
            problems.append(f"rank {rank}: {len(got_aux)} aux states")
        for name, got, want in pairs:
            if got.shape != want.shape:
                problems.append(
                    f"rank {rank} {name}: shape {tuple(got.shape)}, "
                    f"want {tuple(want.shape)}"
                )
            elif not (error := (got - want).abs().max().item()) <= TOLERANCE:
                problems.append(f"rank {rank} {name}: max error {error:.3g}")
    return problems


@pytest.mark.parametrize("architecture", k3_checkpoint.ARCHITECTURES)
def test_sp_across_stages_matches_one_rank_through_the_loaded_class(
    loaded_step, architecture
):
    """A K3 and a K3.1 checkpoint load the same class, and its last stage's
    gathered hidden states and EAGLE-3 aux states at TP2×PP2 with SP equal
    TP1×PP1's, row for row."""
    (expected,) = loaded_step(architecture, 1, 1)
    results = loaded_step(architecture, 2, 2)
    problems = [
        f"rank {rank} loaded {result.architecture}"
        for rank, result in enumerate([expected, *results])
        if result.architecture != K3
    ]
    problems += parity_problems(expected, results[2:], first_rank=2)
    assert not problems, "\n".join(problems)


def test_the_middle_stage_relays_shards_with_attn_res_on(loaded_step):
    """Three stages with AttnRes on: the middle stage receives stage 0's
    shards (tap 1 among them), hands on its own with tap 1 relayed beside
    its tap 2, and the last stage's states equal TP1×PP1's."""
    (expected,) = loaded_step(ATTN_RES, 1, 1)
    results = loaded_step(ATTN_RES, 2, 3)
    middle = results[2:4]
    problems = [
        f"rank {rank}: no SP"
        for rank, result in enumerate(results)
        if not result.sequence_parallel
    ]
    for tp_rank, result in enumerate(middle):
        relayed = sorted(k for k in result.sent if k.startswith("aux_hidden_states_"))
        if len(relayed) != 2:
            problems.append(f"middle TP rank {tp_rank} sends aux {relayed}")
    problems += parity_problems(expected, results[4:], first_rank=4)
    assert not problems, "\n".join(problems)


def test_mtp_drafts_of_the_loaded_class_match_one_rank(loaded_step):
    """K3's MTP layer, loaded by the runner from ``--speculative-config``
    on the last of two SP stages, drafts every position's next token as at
    TP1×PP1: its logits equal, its draft tokens the same."""
    (expected,) = loaded_step(K3, 1, 1, "mtp")
    results = loaded_step(K3, 2, 2, "mtp")
    problems = []
    for rank, result in enumerate(results[2:], start=2):
        if not result.drafter_sequence_parallel:
            problems.append(f"rank {rank}: the MTP block ran replicated")
        got, want = result.draft_logits, expected.draft_logits
        if got is None or got.shape != want.shape:
            problems.append(f"rank {rank}: draft logits {got}")
            continue
        if not (error := (got - want).abs().max().item()) <= MTP_TOLERANCE:
            problems.append(f"rank {rank}: draft logits max error {error:.3g}")
        if not torch.equal(result.draft_tokens, expected.draft_tokens):
            problems.append(
                f"rank {rank}: drafts {result.draft_tokens.tolist()}, "
                f"want {expected.draft_tokens.tolist()}"
            )
    assert not problems, "\n".join(problems)


def draft_problems(
    expected: LoadedStageResult, last_stage: list[LoadedStageResult], first_rank: int
) -> list[str]:
    """Where the last stage's drafter context, draft logits and draft tokens
    differ from the one-rank reference's."""
    problems = []
    for rank, result in enumerate(last_stage, start=first_rank):
        for name in ("draft_context", "draft_logits"):
            got, want = getattr(result, name), getattr(expected, name)
            if got is None or want is None or got.shape != want.shape:
                problems.append(f"rank {rank}: {name} {got}, want {want}")
            elif not (error := (got - want).abs().max().item()) <= TOLERANCE:
                problems.append(f"rank {rank}: {name} max error {error:.3g}")
        if not torch.equal(result.draft_tokens, expected.draft_tokens):
            problems.append(
                f"rank {rank}: drafts {result.draft_tokens.tolist()}, "
                f"want {expected.draft_tokens.tolist()}"
            )
    return problems


def test_eagle3_drafts_of_the_loaded_class_match_one_rank(loaded_step):
    """The EAGLE-3 drafter, loaded by the runner from
    ``--speculative-config`` on the last of two SP stages, drafts every
    position's next token as at TP1×PP1 from the aux states it reads (taps
    1 and 2 crossed the boundary as shards): its combined input and logits
    within ``TOLERANCE``, its draft tokens the same."""
    (expected,) = loaded_step(K3, 1, 1)
    results = loaded_step(K3, 2, 2)
    problems = parity_problems(expected, results[2:], first_rank=2)
    problems += draft_problems(expected, results[2:], first_rank=2)
    assert not problems, "\n".join(problems)


def test_dspark_drafts_of_the_loaded_class_match_one_rank(loaded_step):
    """K3's DSpark drafter (``K3DSparkModel`` from its draft checkpoint),
    loaded by the runner from ``--speculative-config`` on the last of two SP
    stages, reads the target's aux states (taps 1 and 2 crossed the boundary
    as shards) and drafts its block as at TP1×PP1: the aux states and the
    context it combines from them and its block's logits within
    ``TOLERANCE`` (its norms add as at one rank, unlike MTP's), its draft
    tokens the same."""
    (expected,) = loaded_step(K3, 1, 1, "dspark")
    results = loaded_step(K3, 2, 2, "dspark")
    problems = [
        f"rank {rank} loaded {result.architecture}"
        for rank, result in enumerate([expected, *results])
        if result.architecture != K3
    ]
    crossing = sorted(k for k in results[0].sent if k.startswith("aux_hidden_states_"))
    if len(crossing) != 2:
        problems.append(f"stage 0 sends aux states {crossing}")
    problems += parity_problems(expected, results[2:], first_rank=2)
    problems += draft_problems(expected, results[2:], first_rank=2)
    assert not problems, "\n".join(problems)
