# SPDX-License-Identifier: Apache-2.0
"""vLLM's GPU ``Worker`` hands PP tensors off with the model's overrides, on
real TP×PP ranks: each rank runs the real ``Worker.load_model`` and
``Worker.execute_model`` (the worker built without ``__init__``, which wants
a device) around a runner whose ``load_model`` and hand-over are the real
runner's own (0.33.0: the legacy runner's ``load_model`` and
``sync_and_gather_intermediate_tensors``; 0.34.0, which has only Model Runner
V2: its ``load_model`` up to the GPU model state, and the hand-over its
``execute_model`` calls), running the test bed's stage model. The receiver
decides from its own ``all_gather_tensors``
(``GroupCoordinator._should_use_all_gather``), so a receive or a send left
without the overrides takes or sends a 1/TP slice of a shard and all-gathers
other ranks' shards, and a runner that did not keep the declaration refuses
the shard: the last stage's output no longer matches TP1×PP1.
"""

from __future__ import annotations

import contextlib
import types

import torch

from tests.distributed.conftest import topologies
from tests.distributed.test_kimi_k3_stages import TOLERANCE
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER
from tests.sppp_testbed.stages import RUNNER_CAPACITY as CAPACITY
from tests.sppp_testbed.stages import Scenario, token_ids
from tests.sppp_testbed.tiny_k3 import build_model, scenario_config, stand_ins
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.sequence import IntermediateTensors
from vllm.v1.worker import gpu_worker
from vllm.v1.worker.gpu import model_runner as v2
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.pp_intermediate_tensors import (
    hand_off_rows,
    hand_over_intermediate_tensors,
)

if HAS_LEGACY_RUNNER:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

# Not divisible by TP 2: shards of ceil(N / TP) rows, the last one padded.
STEPS = (7, 3, 1)
SEED = 0


class StageRunner:
    """A model runner's part of a step around the test bed's stage model:
    the step's hand-over (``hand_over``) into the persistent buffers, then the
    stage's layers; the output goes back to the worker (kept, and ``None``
    returned, on the last stage)."""

    lora_config = None
    use_aux_hidden_state_outputs = False
    is_pooling_model = False
    device = torch.device("cpu")

    def __init__(self, config) -> None:
        self.vllm_config = config
        self.model_config = types.SimpleNamespace(
            model="tiny-k3", multimodal_config=None
        )
        self.parallel_config = config.parallel_config
        self.compilation_config = config.compilation_config
        self.load_config = config.load_config
        self.jit_warmup_registry = types.SimpleNamespace(
            activate=contextlib.nullcontext
        )
        self.outputs: list[torch.Tensor] = []

    def get_model(self) -> torch.nn.Module:
        return self.model

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if intermediate_tensors is not None:
            intermediate_tensors = self.hand_over(num_tokens, intermediate_tensors)
        output = self.model(
            token_ids(num_tokens, SEED), torch.arange(num_tokens), intermediate_tensors
        )
        if isinstance(output, IntermediateTensors):
            return output
        self.outputs.append(output)
        return None


class LegacyStageRunner(StageRunner):
    """vLLM 0.33.0's legacy runner: its real ``load_model`` (given the built
    model, as ``load_model(model=...)`` takes one) keeps the model's
    declaration, its real ``sync_and_gather_intermediate_tensors`` hands the
    received rows over."""

    if HAS_LEGACY_RUNNER:
        load_model = GPUModelRunner.load_model
        sync_and_gather_intermediate_tensors = (
            GPUModelRunner.sync_and_gather_intermediate_tensors
        )
        _setup_eagle3_aux_hidden_state_outputs = (
            GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
        )
        _pp_hand_off = GPUModelRunner._pp_hand_off  # the class default

    def hand_over(self, num_tokens, received):
        return self.sync_and_gather_intermediate_tensors(num_tokens, received, True)


class ModelStateNeedsAGPU(Exception):
    """Where Model Runner V2's ``load_model`` goes on to build its model
    state (attention backends, sampler buffers), which needs a GPU."""


class V2StageRunner(StageRunner):
    """Model Runner V2: its real ``load_model`` (given the built model) keeps
    the model's declaration, up to the model state it builds next for a GPU;
    a step hands over as its ``execute_model`` does."""

    _pp_hand_off = v2.GPUModelRunner._pp_hand_off  # the class default
    speculator = None
    pp_handler = None
    encoder_cache = None
    eplb = types.SimpleNamespace(prepare_load=lambda: None)

    def load_model(self, load_dummy_weights: bool = False, model=None) -> None:
        def stop(*args):
            raise ModelStateNeedsAGPU

        saved, v2.init_model_state = v2.init_model_state, stop
        try:
            v2.GPUModelRunner.load_model(self, load_dummy_weights, model=model)
        except ModelStateNeedsAGPU:
            pass
        finally:
            v2.init_model_state = saved

    def hand_over(self, num_tokens, received):
        return hand_over_intermediate_tensors(
            self.intermediate_tensors, received, num_tokens, self._pp_hand_off
        )


class StageWorker(Worker):
    """The real ``Worker.load_model``, handing its runner the built model."""

    def __init__(self, config) -> None:  # Worker.__init__ wants a device
        self.vllm_config = config
        self.profiler = None
        self._pp_send_work = []
        if HAS_LEGACY_RUNNER:
            self.use_v2_model_runner = False
            self.model_runner = LegacyStageRunner(config)
        else:  # what 0.34.0's load_model tracks weights with
            self._external_weight_charges = gpu_worker.ExternalWeightCharges()
            self.model_runner = V2StageRunner(config)


def run_worker_steps(steps: tuple[int, ...]) -> tuple[bool, list[torch.Tensor]]:
    """Run in every rank: load the model through ``Worker.load_model``, then
    one ``Worker.execute_model`` per token count."""
    tp, pp = get_tp_group().world_size, get_pp_group().world_size
    config = scenario_config(tp, pp, sp=True)
    threads = torch.get_num_threads()
    with set_current_vllm_config(config), stand_ins(), torch.no_grad():
        worker = StageWorker(config)
        model = build_model(config, SEED)
        runner = worker.model_runner
        load = runner.load_model
        runner.load_model = lambda load_dummy_weights: load(model=model)
        worker.load_model()
        # As the V2 runner allocates them at the end of load_model.
        runner.intermediate_tensors = model.make_empty_intermediate_tensors(
            hand_off_rows(CAPACITY, runner._pp_hand_off),
            torch.get_default_dtype(),
            runner.device,
        )
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
