# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's execute_model on FULL-graph replay steps, on the CPU:
the GPU bundle's checks (tests/gpu/checks.py) with replay as a re-run of
the captured forward. A copy of execute_model that skips the hand-over on
the FULL path must fail them."""

import torch

from tests.gpu import checks
from vllm.v1.worker.gpu.model_runner import GPUModelRunner


def test_full_replay_steps_return_what_each_step_received():
    with checks.declared_topology():
        stage = checks.capture_graphs(torch.device("cpu"))
        assert checks.check_graph_replay(stage, lambda line: None) == []
        assert (
            checks.check_execute_model(
                stage, GPUModelRunner.execute_model, lambda line: None
            )
            == []
        )


def test_skipping_the_full_hand_over_is_caught():
    with checks.declared_topology():
        stage = checks.capture_graphs(torch.device("cpu"))
        planted = checks.execute_model_skipping_full_hand_over()
        problems = checks.check_execute_model(stage, planted, lambda line: None)
    assert "a hand-off of other rows than the shard was not refused" in problems
    assert any("returned other rows" in problem for problem in problems)
