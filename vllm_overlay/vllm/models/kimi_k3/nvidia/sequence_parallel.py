# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When Kimi K3 runs sequence parallel, and what that means across PP stages.

Between attention blocks each TP rank holds only its shard of the token rows.
The layout holds for any pipeline-parallel size: the first stage shards the
embeddings once, every stage hands its shards to the same TP rank of the next
stage, and the last stage gathers once.
"""

from collections.abc import Sequence

import torch

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import EagleModelMixin
from vllm.models.common.ops.sequence_parallel import sp_all_gather, sp_shard_rows
from vllm.sequence import IntermediateTensors

logger = init_logger(__name__)

# Intermediate-tensor keys that hold SP shards, besides the aux-state slots.
SEQUENCE_PARALLEL_PP_KEYS = ("hidden_states", "residual")

# Largest per-rank shard of final and aux hidden states gathered as one packed
# all-gather. Packing saves a launch per aux state but copies every state into
# the packed buffer; on 2 x H200 over NVLink (TP2, bf16) the copy outweighs the
# launches from about 41 MiB per rank.
PACKED_GATHER_MAX_BYTES = 40 * 1024 * 1024


def use_kimi_k3_sequence_parallel(vllm_config: VllmConfig) -> bool:
    """The one place that decides SP for Kimi K3.

    DeepGEMM MegaMoE (and, without PP, DP attention) consume token shards,
    which needs EP and more than one TP rank. Across pipeline stages only
    MegaMoE runs sequence parallel, and not with micro-batches (DBO,
    ``--ubatch-size``): they slice stage hand-offs by token position, which
    shards do not follow. Those keep 0.33.0's replicated layout, as do other
    backends, whose dense and shared-expert weights and traffic are proven.
    """
    parallel_config = vllm_config.parallel_config
    moe_backend = vllm_config.kernel_config.moe_backend
    pp_size = parallel_config.pipeline_parallel_size
    data_parallel = parallel_config.data_parallel_size > 1
    expert_parallel_tp = (
        parallel_config.enable_expert_parallel
        and parallel_config.tensor_parallel_size > 1
    )
    enabled = expert_parallel_tp and (
        moe_backend == "deep_gemm_mega_moe" or (pp_size == 1 and data_parallel)
    )
    if enabled and pp_size > 1 and parallel_config.use_ubatching:
        logger.info_once(
            "Kimi-K3 sequence parallelism off at PP=%d with micro-batches "
            "(--enable-dbo, --ubatch-size): they slice stage hand-offs by "
            "token position, which sequence-parallel shards do not follow.",
            pp_size,
        )
        enabled = False
    elif enabled:
        logger.info_once(
            "Kimi-K3 sequence parallelism enabled (TP=%d, PP=%d, MoE backend=%s).",
            parallel_config.tensor_parallel_size,
            pp_size,
            moe_backend,
        )
    elif expert_parallel_tp and data_parallel:
        logger.info_once(
            "Kimi-K3 sequence parallelism off at PP=%d with MoE backend %s: "
            "across pipeline stages only deep_gemm_mega_moe runs it.",
            pp_size,
            moe_backend,
        )
    return enabled


def sequence_parallel_pp_overrides(num_aux_slots: int) -> dict[str, bool]:
    """``all_gather_tensors`` marking every SP-sharded PP key as not replicated.

    Aux hidden states travel under ``aux_hidden_states_<slot>`` with one slot
    per aux layer of the whole model, so all of them are listed.
    """
    aux_keys = (
        f"{EagleModelMixin.AUX_HIDDEN_STATE_KEY}{slot}" for slot in range(num_aux_slots)
    )
    return dict.fromkeys((*SEQUENCE_PARALLEL_PP_KEYS, *aux_keys), False)


def check_sequence_parallel_rows(
    intermediate_tensors: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """What a later stage received, checked to be its SP shard.

    Every run hands the model exactly ``c = ceil(num_tokens / TP)`` rows:
    real steps the received shard, dummy runs, profiling and CUDA graph
    capture the leading rows of the runner's shard-sized buffers, where a
    real step copies received data. Any other count means the stages padded
    this batch differently (or a runner skipped the row rule), and using it
    would silently mix rows.
    """
    tp_size = get_tensor_model_parallel_world_size()
    rows = sp_shard_rows(num_tokens, tp_size)
    for key, tensor in intermediate_tensors.tensors.items():
        if tensor.shape[0] != rows:
            raise ValueError(
                f"Received {key} with {tensor.shape[0]} rows for a batch of "
                f"N={num_tokens} tokens at TP={tp_size}"
                f": a sequence-parallel hand-off has ceil(N/TP)={rows} rows. "
                "The stages padded the batch differently; start every node "
                "with the same flags."
            )
    return intermediate_tensors


def sp_all_gather_hidden_states(
    states: list[torch.Tensor], num_tokens: int
) -> list[torch.Tensor]:
    """All ``num_tokens`` rows of each SP-sharded state, for the model's end.

    Final and aux hidden states share one all-gather, packed along the
    hidden dimension, while their shards fit ``PACKED_GATHER_MAX_BYTES``;
    larger ones are gathered one by one, which is then faster.
    """
    shard_bytes = sum(state.numel() * state.element_size() for state in states)
    if len(states) == 1 or shard_bytes > PACKED_GATHER_MAX_BYTES:
        return [sp_all_gather(state)[:num_tokens] for state in states]
    packed = sp_all_gather(torch.cat(states, dim=-1))[:num_tokens]
    return list(packed.split([state.shape[-1] for state in states], dim=-1))


def check_aux_hidden_state_layers(
    layers: Sequence[int], num_hidden_layers: int
) -> None:
    """Aux layers outside the model would never be captured, and the drafter
    would fail on a short list deep inside a step; refuse them at start-up."""
    outside = [layer for layer in layers if not 0 <= layer <= num_hidden_layers]
    if outside:
        raise ValueError(
            f"Kimi-K3 has no layer boundary {outside} to capture aux hidden "
            f"states at: eagle_aux_hidden_state_layer_ids must lie in "
            f"[0, {num_hidden_layers}] (got {sorted(layers)})."
        )
