# SPDX-License-Identifier: Apache-2.0
"""One step of the tiny Kimi K3 across PP stages, chained as vLLM chains them.

As ``Worker.execute_model`` does: non-first stages ``irecv_tensor_dict``
into an ``AsyncIntermediateTensors``, non-last stages ``isend_tensor_dict``
their output, both with the TP group as ``all_gather_group`` and the model's
transport overrides as ``all_gather_tensors`` when it has them (contract 4
in docs/architecture.md, "The contracts"). Middle stages relay earlier
stages' aux hidden states with the V2 runner's own
``PPHandler.relay_aux_hidden_states``.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tests.sppp_testbed.accounting import CommLedger
from tests.sppp_testbed.tiny_k3 import (
    VOCAB,
    build_model,
    k3,
    k3_sp,
    scenario_config,
    stand_ins,
)
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu.pp_utils import PPHandler
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
    aux_hidden_state_relay_keys,
    reserve_aux_intermediate_tensor_slots,
)
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

try:  # what the patched worker asks at each hand-off
    from vllm.model_executor.models.interfaces import get_pp_all_gather_overrides
except ImportError:  # pristine vLLM (non-regression runs) sends as 0.33.0 does

    def get_pp_all_gather_overrides(model: torch.nn.Module) -> None:
        return None


@dataclass(frozen=True)
class Scenario:
    """What one step runs: the options a user would set, and the batch."""

    sp: bool
    num_tokens: int
    attn_res: bool = False
    aux_layers: tuple[int, ...] = ()
    seed: int = 0
    # A known bug to inject (FAULTS, BATCH_FAULTS), to prove it is caught.
    fault: str = ""
    # "legacy": later stages take the hand-off through the legacy runner's
    # persistent buffers (GPUModelRunner.sync_and_gather_intermediate_tensors).
    runner: str = ""
    # The seed's serving flags (PRODUCTION_FLAGS), and a forward context whose
    # is_padding marks the batch's last quarter as runner padding.
    production_flags: bool = False
    # Overrides PACKED_GATHER_MAX_BYTES, to put a tiny step above the limit.
    packed_gather_max_bytes: int | None = None

    def __str__(self) -> str:
        options = [f"N={self.num_tokens}", "SP" if self.sp else "no SP"]
        if self.attn_res:
            options.append("AttnRes")
        if self.aux_layers:
            options.append(f"aux={list(self.aux_layers)}")
        if self.fault:
            options.append(f"fault={self.fault}")
        if self.runner:
            options.append(f"runner={self.runner}")
        if self.production_flags:
            options.append("production flags")
        if self.packed_gather_max_bytes is not None:
            options.append(f"packed gather <= {self.packed_gather_max_bytes} B")
        return ", ".join(options)


@dataclass
class StageResult:
    sequence_parallel: bool
    layers: tuple[int, int]
    ledger: CommLedger
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    # Dense and shared-expert MLPs of this stage that run TP-sharded.
    sharded_mlps: int = 0
    # With production flags: the runner's padding mask and what the model
    # left in the forward context (this rank's rows under SP).
    dispatched_padding: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    # The packed end gather's limit this step ran with.
    packed_gather_max_bytes: int = 0


# The seed's serve command sets the first; the second is 0.33.0's default,
# set explicitly so the test bed does not depend on it.
PRODUCTION_FLAGS = {
    "VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT": "1",
    "VLLM_MOE_SKIP_PADDING": "1",
}


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """Set ``variables`` for the step (vLLM reads them as it builds and runs
    the model) and restore the rank's environment afterwards."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def forward_context(
    scenario: Scenario, num_tokens: int
) -> Iterator[ForwardContext | None]:
    """A forward context as a runner sets it, with the batch's last quarter
    marked as padding, for the production-flag scenarios; none otherwise."""
    if not scenario.production_flags:
        yield None
        return
    is_padding = torch.arange(num_tokens) >= num_tokens - num_tokens // 4
    context = ForwardContext(
        no_compile_layers={}, attn_metadata={}, slot_mapping={}, is_padding=is_padding
    )
    with override_forward_context(context):
        yield context


def gather_by_shape(model: torch.nn.Module) -> None:
    """A gather skipped because a row count, not the SP flag, decided."""
    gather = k3.sp_all_gather
    k3.sp_all_gather = lambda x: x if x.shape[0] == 1 else gather(x)
    if k3_sp is not None:  # the end gather
        k3_sp.sp_all_gather = k3.sp_all_gather


def shift_aux_slots(model: torch.nn.Module) -> None:
    """The first stage numbers its aux slots from 1 instead of 0."""
    if get_pp_group().is_first_rank:
        model._aux_slot_base_cached += 1


def expect_extra_aux_key(model: torch.nn.Module) -> None:
    """The last stage expects one relayed aux key more than was sent."""
    if get_pp_group().is_last_rank:
        model._aux_upstream_total_cached += 1


FAULTS = {
    "gather_by_shape": gather_by_shape,
    "shift_aux_slots": shift_aux_slots,
    "expect_extra_aux_key": expect_extra_aux_key,
}


def pad_batch_to_tp(num_tokens: int) -> int:
    """The batch is padded to TP rows and the padding is never trimmed, as a
    runner that forgets ``N`` would do."""
    return max(num_tokens, get_tp_group().world_size)


def sender_pads_more(num_tokens: int) -> int:
    """The first stage pads the batch by 2·TP tokens more than the others,
    as a stage started with other CUDA graph sizes would."""
    if get_pp_group().is_first_rank:
        return num_tokens + 2 * get_tp_group().world_size
    return num_tokens


# Faults in the batch a stage runs: the token count it dispatches.
BATCH_FAULTS = {
    "pad_batch_to_tp": pad_batch_to_tp,
    "sender_pads_more": sender_pads_more,
}


# The legacy runner's persistent receive buffers: max_num_tokens rows.
RUNNER_CAPACITY = 128


def through_legacy_runner(
    model: torch.nn.Module, received: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """What the legacy runner hands the model after a hand-off: the received
    rows copied into its full-capacity buffers by its own code."""
    # The runner's view of the model: aux relay slots reserved in its
    # buffers, as set_eagle3_aux_hidden_state_layers does.
    wrapper = types.SimpleNamespace(
        model=model,
        make_empty_intermediate_tensors=model.make_empty_intermediate_tensors,
    )
    reserve_aux_intermediate_tensor_slots(wrapper)
    runner = types.SimpleNamespace(
        intermediate_tensors=wrapper.make_empty_intermediate_tensors(
            RUNNER_CAPACITY, torch.get_default_dtype(), torch.device("cpu")
        ),
        get_model=lambda: model,
    )
    return GPUModelRunner.sync_and_gather_intermediate_tensors(
        runner, num_tokens, received, True
    )


def token_ids(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_tokens,), generator=generator)


def run_step(scenario: Scenario) -> StageResult:
    """Run in every rank; the last stage's result carries the outputs."""
    tp_group, pp_group = get_tp_group(), get_pp_group()
    config = scenario_config(
        tp_group.world_size,
        pp_group.world_size,
        sp=scenario.sp,
        attn_res=scenario.attn_res,
    )
    ledger = CommLedger()
    with (
        environment(PRODUCTION_FLAGS if scenario.production_flags else {}),
        set_current_vllm_config(config),
        stand_ins(),
        torch.no_grad(),
        ledger.watching(tp_group, pp_group),
    ):
        model = build_model(config, scenario.seed)
        if scenario.packed_gather_max_bytes is not None:
            k3_sp.PACKED_GATHER_MAX_BYTES = scenario.packed_gather_max_bytes
        if scenario.aux_layers:
            model._set_aux_hidden_state_layers(scenario.aux_layers)
        if scenario.fault in FAULTS:
            FAULTS[scenario.fault](model)
        ledger.watch_stage(model)
        overrides = get_pp_all_gather_overrides(model)
        result = StageResult(
            model.use_sequence_parallel,
            (model.start_layer, model.end_layer),
            ledger,
            sharded_mlps=sum(
                isinstance(module, k3.KimiMLP) and module.shard_sequence_parallel
                for module in model.modules()
            ),
            packed_gather_max_bytes=getattr(k3_sp, "PACKED_GATHER_MAX_BYTES", 0),
        )
        intermediate = None
        if not pp_group.is_first_rank:
            with ledger.in_phase("PP recv"):
                tensors, handles, postprocess = pp_group.irecv_tensor_dict(
                    all_gather_group=tp_group, all_gather_tensors=overrides
                )
                intermediate = AsyncIntermediateTensors(
                    tensors, comm_handles=handles, comm_postprocess=postprocess
                )
                intermediate.wait_for_comm()
        num_tokens = scenario.num_tokens
        if scenario.fault in BATCH_FAULTS:
            num_tokens = BATCH_FAULTS[scenario.fault](num_tokens)
        if intermediate is not None and scenario.runner == "legacy":
            intermediate = through_legacy_runner(model, intermediate, num_tokens)
        ids = token_ids(scenario.num_tokens, scenario.seed)
        ids = torch.cat([ids, ids.new_zeros(num_tokens - ids.shape[0])])
        with (
            ledger.in_phase("layers"),
            forward_context(scenario, num_tokens) as context,
        ):
            if context is not None:
                result.dispatched_padding = context.is_padding
            output = model(ids, torch.arange(num_tokens), intermediate)
            if context is not None:
                result.padding_mask = context.is_padding
        if not pp_group.is_last_rank:
            assert isinstance(output, IntermediateTensors)
            relay = types.SimpleNamespace(
                aux_hidden_state_relay_keys=aux_hidden_state_relay_keys(
                    types.SimpleNamespace(model=model)
                )
            )
            output = PPHandler.relay_aux_hidden_states(relay, intermediate, output)
            with ledger.in_phase("PP send"):
                for handle in pp_group.isend_tensor_dict(
                    output.tensors,
                    all_gather_group=tp_group,
                    all_gather_tensors=overrides,
                ):
                    if handle is not None:
                        handle.wait()
            return result
    if isinstance(output, tuple):
        result.hidden_states, result.aux_hidden_states = output
    else:
        result.hidden_states = output
    return result
