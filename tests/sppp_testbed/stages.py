# SPDX-License-Identifier: Apache-2.0
"""One step of the tiny Kimi K3 across PP stages, chained as vLLM chains them.

As ``Worker.execute_model`` does: non-first stages ``irecv_tensor_dict``
into an ``AsyncIntermediateTensors``, non-last stages ``isend_tensor_dict``
their output, both with the TP group as ``all_gather_group`` and the model's
transport overrides as ``all_gather_tensors`` when it has them (contract 4
in docs/architecture.md, "The contracts"). Middle stages relay earlier
stages' aux hidden states with the V2 runner's own
``PPHandler.relay_aux_hidden_states``. With a drafter, the last stage then
feeds it as the V2 runner does: vLLM's MTP layer on the target's gathered
hidden states, or DSpark's input built from the aux list in slot order.

``Scenario(handoff="replicated")`` runs the same SP model with vLLM 0.34.0's
hand-off for DeepSeek V4.1 and MiniMax-M3 wrapped around its stage boundary,
a comparison arm the series never installs: each non-last stage all-gathers
its shards before the send, the transport keeps its replicated default
(a 1/TP slice sent, all-gathered on the receiver) and the next stage shards
what it received before its layers run.

A dummy run (``Scenario(dummy_run=True)``) is what memory profiling, the
dummy runs and CUDA graph capture run on every stage alone, with no PP
traffic: later stages get the leading rows of the runner's receive buffers
(sized by the model's declaration: its shard of the runner's capacity under
SP) through the series' hand-over, exactly the rows a real step hands.
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
    MAX_NUM_BATCHED_TOKENS,
    NUM_LAYERS,
    VOCAB,
    TokenwiseExperts,
    build_dspark_context,
    build_model,
    build_mtp,
    draft_config,
    k3,
    k3_mtp,
    k3_sp,
    scenario_config,
    stand_ins,
)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.models.common.ops import sequence_parallel as sp_ops
from vllm.sequence import IntermediateTensors
from vllm.utils.math_utils import cdiv
from vllm.v1.worker.gpu.pp_utils import PPHandler
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
    aux_hidden_state_relay_keys,
    reserve_aux_intermediate_tensor_slots,
)
from vllm.v1.worker.gpu.spec_decode.utils import get_drafter_hidden_states
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors

try:  # the legacy runner: vLLM 0.33.0 only (0.34.0 deleted it)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
except ImportError:
    GPUModelRunner = None

try:  # what the patched worker asks at each hand-off
    from vllm.model_executor.models.interfaces import get_pp_all_gather_overrides
except ImportError:  # pristine vLLM (non-regression runs) sends as 0.33.0 does

    def get_pp_all_gather_overrides(model: torch.nn.Module) -> None:
        return None


try:  # what the patched runners keep from load_model
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
except ImportError:  # pristine vLLM's runner keeps nothing

    def get_pp_hand_off_declaration(model: torch.nn.Module) -> None:
        return None


try:  # what the patched runners hand the model, and how they size buffers
    from vllm.v1.worker.pp_intermediate_tensors import (
        hand_off_rows,
        hand_over_intermediate_tensors,
    )
except ImportError:  # pristine vLLM's V2 runner: full buffers, a dummy run's N

    def hand_off_rows(num_tokens, hand_off):
        return num_tokens

    def hand_over_intermediate_tensors(buffers, received, num_tokens, hand_off):
        assert received is None, "pristine real steps are not run this way"
        return buffers[:num_tokens]


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
    # The target's depth (K3-like tap layouts need more layers than 4).
    num_layers: int = NUM_LAYERS
    # The drafter the last stage feeds after the target: "mtp" (vLLM's MTP
    # layer) or "dspark" (its input, built from the aux states).
    drafter: str = ""
    # --speculative-config's moe_backend, laid over the drafter's config.
    draft_moe_backend: str | None = None
    # Decode-shaped batch: requests of query_len = 1 + k tokens each, none at
    # position 0 (0: one prefill sequence at positions 0..N-1).
    query_len: int = 0
    # VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1: AttnRes aux taps capture the stream.
    aux_attn_res_stream: bool = False
    # DSA on every full-attention layer (dsa_config; vLLM 0.34.0).
    dsa: bool = False
    # A dummy run (profiling, dummy runs, capture) on every stage alone,
    # later stages on the runner's receive buffers; no PP traffic.
    dummy_run: bool = False
    # How SP stages hand on their shards (HANDOFFS): "sharded", the series'
    # shard-to-shard transport, or "replicated", 0.34.0's gather, send,
    # re-shard (a comparison arm; the same as "sharded" where SP is off).
    handoff: str = "sharded"

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
        if self.num_layers != NUM_LAYERS:
            options.append(f"{self.num_layers} layers")
        if self.drafter:
            options.append(f"drafter={self.drafter}")
        if self.draft_moe_backend:
            options.append(f"draft moe_backend={self.draft_moe_backend}")
        if self.query_len:
            options.append(f"requests of {self.query_len} tokens")
        if self.aux_attn_res_stream:
            options.append("AttnRes aux stream")
        if self.dsa:
            options.append("DSA")
        if self.dummy_run:
            options.append("dummy run")
        if self.handoff != "sharded":
            options.append(f"{self.handoff} hand-off")
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
    # With a drafter, on the last stage: whether its block ran SP; the MTP
    # layer's (logits input, recurrent state); DSpark's combined input; and
    # whether each aux state it was built from was contiguous.
    drafter_sequence_parallel: bool | None = None
    mtp_states: tuple[torch.Tensor, torch.Tensor] | None = None
    drafter_input: torch.Tensor | None = None
    aux_contiguous: list[bool] | None = None
    # With production flags: the MTP layer's forward context's mask after it
    # ran (this rank's rows under SP).
    drafter_padding_mask: torch.Tensor | None = None
    # The most tokens any MoE layer of this stage ran, and what MegaMoE's
    # buffer holds there (None: another backend).
    moe_tokens: int = 0
    moe_max_num_tokens: int | None = None
    # A non-last stage's output rows (what it hands on).
    output_rows: int | None = None
    # The attention class of each of this stage's layers (stand-ins' names).
    attention: tuple[str, ...] = ()


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


def mtp_skips_gather(model: torch.nn.Module) -> None:
    """The MTP layer returns its block's shard without gathering it."""
    k3_mtp.sp_all_gather = lambda x: x


def skip_narrowing(model: torch.nn.Module) -> None:
    """A dummy run's hand-over skips the row rule: later stages get the first
    N rows of full-capacity buffers, as before the buffers were shard-sized
    (applied in :func:`dummy_run_inputs`)."""


def narrow_twice(model: torch.nn.Module) -> None:
    """Later stages narrow the shard they were handed once more: the first
    ceil(c/TP) rows of its c."""
    check = k3.check_sequence_parallel_rows

    def narrowed(tensors: IntermediateTensors, num_tokens: int) -> IntermediateTensors:
        tensors = check(tensors, num_tokens)
        rows = cdiv(intermediate_rows(tensors), get_tp_group().world_size)
        return tensors[:rows]

    k3.check_sequence_parallel_rows = narrowed


FAULTS = {
    "gather_by_shape": gather_by_shape,
    "skip_narrowing": skip_narrowing,
    "narrow_twice": narrow_twice,
    "shift_aux_slots": shift_aux_slots,
    "expect_extra_aux_key": expect_extra_aux_key,
    "mtp_skips_gather": mtp_skips_gather,
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


# How SP stages hand their shards to the next stage. "sharded" is the series
# (contract 4): each key goes from TP rank r to TP rank r of the next stage as
# it is. "replicated" is vLLM 0.34.0's way for DeepSeek V4.1 and MiniMax-M3,
# applied to Kimi K3 around the model's stage boundary for comparison.
HANDOFFS = ("sharded", "replicated")


def gather_before_send(
    output: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """A non-last stage's shards made TP-replicated for vLLM's transport, as
    MiniMax-M3 does in 0.34.0: every key in one all-gather packed along the
    hidden dimension (the AttnRes bank flattened), trimmed to the batch's
    ``num_tokens`` rows and split back."""
    tensors = output.tensors
    flat = [tensor.reshape(tensor.shape[0], -1) for tensor in tensors.values()]
    packed = sp_ops.sp_all_gather(torch.cat(flat, dim=-1))[:num_tokens]
    parts = packed.split([tensor.shape[1] for tensor in flat], dim=-1)
    return IntermediateTensors(
        {
            key: part.reshape(num_tokens, *tensor.shape[1:])
            for (key, tensor), part in zip(tensors.items(), parts, strict=True)
        }
    )


def shard_after_recv(received: IntermediateTensors) -> IntermediateTensors:
    """The replicated rows a later stage received, cut to this TP rank's
    shard before its layers run (``sp_shard``: zero-padded to TP·c rows)."""
    return IntermediateTensors(
        {key: sp_ops.sp_shard(tensor) for key, tensor in received.tensors.items()}
    )


def skip_reshard(received: IntermediateTensors) -> IntermediateTensors:
    """The replicated arm hands the model the N received rows unsharded."""
    return received


# Faults of the replicated arm's receiving side.
HANDOFF_FAULTS = {"skip_reshard": skip_reshard}


# The runners' capacity (max_num_tokens); their persistent receive buffers
# hold hand_off_rows(RUNNER_CAPACITY, declaration) rows.
RUNNER_CAPACITY = MAX_NUM_BATCHED_TOKENS


def receive_buffers(
    model: torch.nn.Module, rows: int | None = None
) -> IntermediateTensors:
    """A runner's persistent receive buffers for ``model``: as many rows as
    its declaration gives the runner's capacity, unless ``rows`` says."""
    if rows is None:
        rows = hand_off_rows(RUNNER_CAPACITY, get_pp_hand_off_declaration(model))
    return model.make_empty_intermediate_tensors(
        rows, torch.get_default_dtype(), torch.device("cpu")
    )


def through_legacy_runner(
    model: torch.nn.Module, received: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """What the legacy runner hands the model after a hand-off: the received
    rows copied into its receive buffers (sized as its _dummy_run sizes
    them) by its own code."""
    # The runner's view of the model: aux relay slots reserved in its
    # buffers, as set_eagle3_aux_hidden_state_layers does.
    wrapper = types.SimpleNamespace(
        model=model,
        make_empty_intermediate_tensors=model.make_empty_intermediate_tensors,
    )
    reserve_aux_intermediate_tensor_slots(wrapper)
    runner = types.SimpleNamespace(
        intermediate_tensors=wrapper.make_empty_intermediate_tensors(
            hand_off_rows(RUNNER_CAPACITY, get_pp_hand_off_declaration(model)),
            torch.get_default_dtype(),
            torch.device("cpu"),
        ),
        get_model=lambda: model,
        _pp_hand_off=get_pp_hand_off_declaration(model),
    )
    return GPUModelRunner.sync_and_gather_intermediate_tensors(
        runner, num_tokens, received, True
    )


def intermediate_rows(output: IntermediateTensors) -> int:
    (rows,) = {tensor.shape[0] for tensor in output.tensors.values()}
    return rows


def dummy_run_inputs(
    model: torch.nn.Module, num_tokens: int, seed: int, fault: str = ""
) -> IntermediateTensors | None:
    """What the V2 runner hands a later stage's model on a dummy run (memory
    profiling, ``_dummy_run``, capture): the leading rows of its receive
    buffers, through the hand-over with nothing received. They hold whatever
    was there; here, seeded values. ``fault="skip_narrowing"``: the first
    ``num_tokens`` rows of full-capacity buffers, the row rule skipped."""
    if get_pp_group().is_first_rank:
        return None
    skip = fault == "skip_narrowing"
    buffers = receive_buffers(model, RUNNER_CAPACITY if skip else None)
    generator = torch.Generator().manual_seed(seed)
    for tensor in buffers.tensors.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    if skip:
        return buffers[:num_tokens]
    return hand_over_intermediate_tensors(
        buffers, None, num_tokens, get_pp_hand_off_declaration(model)
    )


def token_ids(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_tokens,), generator=generator)


def step_positions(scenario: Scenario, num_tokens: int) -> torch.Tensor:
    """One sequence from position 0, or decode requests of ``query_len``
    tokens each, request ``i`` continuing a context of ``3 + 5 i`` tokens."""
    if not scenario.query_len:
        return torch.arange(num_tokens)
    assert num_tokens % scenario.query_len == 0, "whole requests only"
    starts = 3 + 5 * torch.arange(num_tokens // scenario.query_len)
    return (starts[:, None] + torch.arange(scenario.query_len)).flatten()


def run_drafter(
    scenario: Scenario,
    config: VllmConfig,
    result: StageResult,
    model: torch.nn.Module,
    positions: torch.Tensor,
    ledger: CommLedger,
) -> None:
    """Feed the drafter on the last stage as the V2 runner does, from the
    target's gathered outputs (``get_drafter_hidden_states``)."""
    num_tokens = positions.shape[0]
    hidden_states = get_drafter_hidden_states(model, result.hidden_states)
    aux = result.aux_hidden_states or []
    result.aux_contiguous = [state.is_contiguous() for state in aux]
    if scenario.drafter == "mtp":
        # Built with the target's VllmConfig, as load_eagle_model builds it.
        drafter = build_mtp(
            draft_config(config, scenario.draft_moe_backend), scenario.seed
        )
        layer = next(iter(drafter.layers.values()))
        result.drafter_sequence_parallel = layer.mtp_block.use_sequence_parallel
        # The drafter's tokens (serving shifts the target's by one and appends
        # the sampled one): any ids the reference reads too.
        ids = token_ids(num_tokens, scenario.seed + 1)
        # A forward context of the drafter's own with an N-row mask (the V2
        # speculator passes none, which sp_padding_mask takes as all False).
        with (
            ledger.in_phase("drafter"),
            ledger.counting(k3_mtp, "sp_shard"),
            forward_context(scenario, num_tokens) as context,
        ):
            result.mtp_states = drafter(ids, positions, hidden_states)
        if context is not None:
            result.drafter_padding_mask = context.is_padding
        return
    assert scenario.drafter == "dspark", scenario.drafter
    # DSpark stores its context as DFlashSpeculator._store_hidden_states does:
    # combine_hidden_states(cat of the aux list in slot order).
    context = build_dspark_context(len(aux), scenario.seed)
    speculator = types.SimpleNamespace(
        _aux_staging=None,
        model=context,
        hidden_states=hidden_states.new_zeros(num_tokens, hidden_states.shape[-1]),
    )
    with ledger.in_phase("drafter"):
        DFlashSpeculator._store_hidden_states(
            speculator, num_tokens, hidden_states, aux
        )
    result.drafter_input = speculator.hidden_states


def run_step(scenario: Scenario) -> StageResult:
    """Run in every rank; the last stage's result carries the outputs."""
    tp_group, pp_group = get_tp_group(), get_pp_group()
    config = scenario_config(
        tp_group.world_size,
        pp_group.world_size,
        sp=scenario.sp,
        attn_res=scenario.attn_res,
        num_layers=scenario.num_layers,
        dsa=scenario.dsa,
    )
    ledger = CommLedger()
    variables = dict(PRODUCTION_FLAGS) if scenario.production_flags else {}
    if scenario.aux_attn_res_stream:
        variables["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"] = "1"
    with (
        environment(variables),
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
        assert scenario.handoff in HANDOFFS, scenario.handoff
        replicated = scenario.handoff == "replicated" and model.use_sequence_parallel
        # The replicated arm sends with the transport's default: every key
        # TP-replicated, whatever the model declares.
        overrides = None if replicated else get_pp_all_gather_overrides(model)
        result = StageResult(
            model.use_sequence_parallel,
            (model.start_layer, model.end_layer),
            ledger,
            sharded_mlps=sum(
                isinstance(module, k3.KimiMLP) and module.shard_sequence_parallel
                for module in model.modules()
            ),
            packed_gather_max_bytes=getattr(k3_sp, "PACKED_GATHER_MAX_BYTES", 0),
            attention=tuple(
                type(layer.self_attn).__name__
                for layer in model.layers[model.start_layer : model.end_layer]
            ),
        )
        intermediate = None
        if scenario.dummy_run:
            intermediate = dummy_run_inputs(
                model, scenario.num_tokens, scenario.seed, scenario.fault
            )
        elif not pp_group.is_first_rank:
            with ledger.in_phase("PP recv"):
                tensors, handles, postprocess = pp_group.irecv_tensor_dict(
                    all_gather_group=tp_group, all_gather_tensors=overrides
                )
                intermediate = AsyncIntermediateTensors(
                    tensors, comm_handles=handles, comm_postprocess=postprocess
                )
                intermediate.wait_for_comm()
                if replicated:
                    reshard = HANDOFF_FAULTS.get(scenario.fault, shard_after_recv)
                    with ledger.counting(sp_ops, "sp_shard"):
                        intermediate = reshard(intermediate)
        num_tokens = scenario.num_tokens
        if scenario.fault in BATCH_FAULTS:
            num_tokens = BATCH_FAULTS[scenario.fault](num_tokens)
        if intermediate is not None and scenario.runner == "legacy":
            intermediate = through_legacy_runner(model, intermediate, num_tokens)
        ids = token_ids(scenario.num_tokens, scenario.seed)
        ids = torch.cat([ids, ids.new_zeros(num_tokens - ids.shape[0])])
        positions = step_positions(scenario, num_tokens)
        with (
            ledger.in_phase("layers"),
            forward_context(scenario, num_tokens) as context,
        ):
            if context is not None:
                result.dispatched_padding = context.is_padding
            output = model(ids, positions, intermediate)
            if context is not None:
                result.padding_mask = context.is_padding
        moes = [m for m in model.modules() if isinstance(m, TokenwiseExperts)]
        if moes:
            result.moe_tokens = max(m.most_tokens for m in moes)
            result.moe_max_num_tokens = moes[0].max_num_tokens
        if not pp_group.is_last_rank:
            assert isinstance(output, IntermediateTensors)
            result.output_rows = intermediate_rows(output)
            if scenario.dummy_run:
                return result  # a dummy run hands nothing on
            relay = types.SimpleNamespace(
                aux_hidden_state_relay_keys=aux_hidden_state_relay_keys(
                    types.SimpleNamespace(model=model)
                )
            )
            output = PPHandler.relay_aux_hidden_states(relay, intermediate, output)
            with ledger.in_phase("PP send"):
                if replicated:
                    output = gather_before_send(output, num_tokens)
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
        if scenario.drafter:
            run_drafter(scenario, config, result, model, positions, ledger)
    return result
