# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's execute_model on FULL-graph replay steps, on the CPU:
the GPU bundle's checks (tests/gpu/checks.py) with replay as a re-run of
the captured forward. A copy of execute_model that skips the hand-over on
the FULL path must fail them."""

import torch

from tests.gpu import checks
from tests.sppp_testbed.cpu_platform import accept_x86_without_triton
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

# The checks build VllmConfigs, which vLLM 0.34.0 refuses on this CPU host
# without Triton's CPU backend (the GPU bundle runs them where it is not).
accept_x86_without_triton()


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


def test_last_stage_replay_returns_what_each_size_computed():
    """On the last stage the capture keeps hidden states, not a hand-off:
    each size's replay returns its own N rows, computed from what the
    runner handed over into the persistent buffers."""
    with checks.declared_topology(last_stage=True):
        stage = checks.capture_graphs(torch.device("cpu"), checks.LastStage())
        descs = stage.manager._capture_descs[CUDAGraphMode.FULL]
        assert sorted(d.num_tokens for d in descs) == checks.CAPTURE_SIZES
        for seed, desc in enumerate(descs):
            num_tokens = desc.num_tokens
            received = checks.received_shard(num_tokens, seed, stage.device)
            for key, tensor in received.items():
                stage.buffers[key][:num_tokens] = tensor
            want = checks.eager_output(stage, received, num_tokens)
            got = stage.manager.run_fullgraph(desc)
            assert got.shape == (num_tokens, checks.HIDDEN)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_capture_outputs_hold_the_shard_of_the_widest_graph():
    """A non-last stage's capture outputs hold the declared rows of the
    widest graph, ceil(32 / 2) here: the most any replay returns. The
    widest graph's 32 rows would leave half of them never written."""
    with checks.declared_topology():
        stage = checks.capture_graphs(torch.device("cpu"))
    widest = max(checks.CAPTURE_SIZES)
    outputs = stage.manager.intermediate_tensors.tensors.values()
    assert {t.shape[0] for t in outputs} == {-(-widest // checks.DECLARED_TP)}
