# SPDX-License-Identifier: Apache-2.0
"""The class a user's checkpoint loads, started by vLLM's worker and V2 runner.

A tiny Kimi K3 checkpoint directory (``tests/sppp_testbed/k3_checkpoint.py``)
is served as ``vllm serve`` would start it: vLLM's loader builds
``KimiK3ForConditionalGeneration`` from its ``config.json`` through the model
registry, vLLM's V2 runner loads it with an EAGLE-3 drafter (taps inside
stage 0 and at its boundary), and vLLM's worker takes the transport
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
from tests.sppp_testbed.loaded_stages import run_loaded_step, write_eagle3_dir

TOLERANCE = 1e-12
NUM_TOKENS = 17
PRELOAD = ("tests.sppp_testbed.loaded_stages",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, str]:
    """The K3 checkpoint directory and an EAGLE-3 draft directory."""
    root = tmp_path_factory.mktemp("k3-checkpoint")
    target = k3_checkpoint.write_checkpoint(root / "kimi-k3")
    draft = write_eagle3_dir(root / "eagle3")
    return str(target), str(draft)


@pytest.fixture(scope="module")
def loaded_ranks(pools):
    """TP2×PP2 ranks of their own: vLLM's CPU worker module, which these
    ranks import, patches torch's CUDA entry points process-wide."""
    return pools(2, 2, preload=PRELOAD)


def test_every_aux_state_that_crosses_a_stage_is_declared_shard_to_shard(
    loaded_ranks, checkpoint
):
    """The worker's overrides, taken after the runner's load_model set
    EAGLE-3's aux layers, declare each aux key that crosses stage 0's
    boundary shard-to-shard (False), and the aux states TP rank r of stage
    1 receives are the shards TP rank r of stage 0 sent."""
    target, draft = checkpoint
    results = loaded_ranks.run(run_loaded_step, target, draft, True, NUM_TOKENS)
    problems = []
    for rank, result in enumerate(results):
        if result.architecture != "KimiK3ForConditionalGeneration":
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
