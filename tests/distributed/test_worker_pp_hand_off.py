# SPDX-License-Identifier: Apache-2.0
"""vLLM's GPU ``Worker`` hands PP tensors off with the model's overrides, on
real TP×PP ranks: each rank builds the real ``Worker`` (``Worker.__new__``
plus what ``load_model`` and ``execute_model`` read) around a runner that runs
the test bed's stage model, and ``Worker.execute_model`` does every receive
and send. 0.33.0's receiver decides from its own ``all_gather_tensors``
(``GroupCoordinator._should_use_all_gather``), so a receive or a send left
without the overrides takes or sends a 1/TP slice of a shard and all-gathers
other ranks' shards: the last stage's output no longer matches TP1×PP1.
"""

from __future__ import annotations

import types

import torch

from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import TOLERANCE
from tests.sppp_testbed.stages import (
    Scenario,
    through_legacy_runner,
    token_ids,
)
from tests.sppp_testbed.tiny_k3 import build_model, scenario_config, stand_ins
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu_worker import Worker

# Not divisible by TP 2: shards of ceil(N / TP) rows, the last one padded.
STEPS = (7, 3, 1)
SEED = 0


class StageRunner:
    """The model runner's part of a step: the received rows handed over by
    the legacy runner's own code, the stage's layers run, the output
    returned to the worker (kept, and ``None`` returned, on the last stage)."""

    def __init__(self, config) -> None:
        self.config = config
        self.outputs: list[torch.Tensor] = []

    def load_model(self, load_dummy_weights: bool = False) -> None:
        self.model = build_model(self.config, SEED)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if intermediate_tensors is not None:
            intermediate_tensors = through_legacy_runner(
                self.model, intermediate_tensors, num_tokens
            )
        output = self.model(
            token_ids(num_tokens, SEED), torch.arange(num_tokens), intermediate_tensors
        )
        if isinstance(output, IntermediateTensors):
            return output
        self.outputs.append(output)
        return None


def run_worker_steps(steps: tuple[int, ...]) -> tuple[bool, list[torch.Tensor]]:
    """Run in every rank: load the model through ``Worker.load_model``, then
    one ``Worker.execute_model`` per token count."""
    tp, pp = get_tp_group().world_size, get_pp_group().world_size
    config = scenario_config(tp, pp, sp=True)
    threads = torch.get_num_threads()
    with set_current_vllm_config(config), stand_ins(), torch.no_grad():
        worker = Worker.__new__(Worker)
        worker.vllm_config = config
        worker.use_v2_model_runner = False
        worker.profiler = None
        worker._pp_send_work = []
        worker.model_runner = StageRunner(config)
        worker.load_model()
        torch.set_num_threads(threads)  # load_model sets serving's count
        for num_tokens in steps:
            step = types.SimpleNamespace(total_num_scheduled_tokens=num_tokens)
            assert worker.execute_model(step) is None
        for handle in worker._pp_send_work:  # the last step's sends
            handle.wait()
    return worker.model_runner.model.use_sequence_parallel, worker.model_runner.outputs


@topologies((2, 2))
def test_worker_execute_model_hands_off_sp_shards(pool, reference):
    results = pool.run(run_worker_steps, STEPS)
    assert all(sequence_parallel for sequence_parallel, _ in results)
    problems = []
    for rank, (_, outputs) in enumerate(
        results[-pool.tp :], start=pool.world - pool.tp
    ):
        assert len(outputs) == len(STEPS)
        for num_tokens, got in zip(STEPS, outputs, strict=True):
            want = reference(Scenario(sp=False, num_tokens=num_tokens)).hidden_states
            if got.shape != want.shape:
                problems.append(f"rank {rank} N={num_tokens}: shape {tuple(got.shape)}")
            # Not "error > TOLERANCE": a NaN (from unwritten rows) fails too.
            elif not (error := (got - want).abs().max().item()) <= TOLERANCE:
                problems.append(f"rank {rank} N={num_tokens}: max error {error:.3g}")
    assert not problems, problems
