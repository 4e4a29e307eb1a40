# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline-parallel hand-off of sequence-parallel (SP) activations.

Under SP each TP rank holds rows ``[r * c, (r + 1) * c)`` of the zero-padded
token sequence, ``c = ceil(N / TP)``. Such tensors differ across TP ranks, so
the PP transport must move each shard from TP rank ``r`` of one stage to TP
rank ``r`` of the next instead of slicing and re-gathering them as it does for
TP-replicated tensors. Models declare which keys are shards; every place that
sends or receives intermediate tensors asks them through this module.
"""

from torch import nn

from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.sequence import IntermediateTensors
from vllm.utils.math_utils import cdiv


def sequence_parallel_rows(num_tokens: int) -> int:
    """Rows of this TP rank's SP shard of ``num_tokens`` tokens."""
    return cdiv(num_tokens, get_tensor_model_parallel_world_size())


def intermediate_tensors_num_rows(intermediate_tensors: IntermediateTensors) -> int:
    """The leading-row count every tensor of a PP hand-off shares.

    Runners take it from what arrived instead of assuming ``num_tokens``: a
    model that keeps its stage outputs sequence parallel sends fewer rows.
    """
    rows = {key: tensor.shape[0] for key, tensor in intermediate_tensors.items()}
    counts = set(rows.values())
    if len(counts) != 1:
        raise ValueError(
            "Intermediate tensors must share one leading-row count; got "
            + (", ".join(f"{key}: {count}" for key, count in rows.items()) or "none")
        )
    return counts.pop()


def received_num_rows(
    intermediate_tensors: IntermediateTensors, num_tokens: int
) -> int:
    """How many rows of a received hand-off a runner copies and hands over.

    All of them, at most ``num_tokens``: each TP rank of a sequence-parallel
    model receives its ``ceil(num_tokens / TP)``-row shard; other models send
    ``num_tokens`` rows.
    """
    return min(num_tokens, intermediate_tensors_num_rows(intermediate_tensors))


def hand_over_intermediate_tensors(
    buffers: IntermediateTensors,
    received: IntermediateTensors | None,
    num_tokens: int,
) -> IntermediateTensors:
    """What a runner hands the model on a non-first PP stage.

    A real step copies the received rows into the leading rows of the
    persistent ``buffers`` and hands exactly those rows. Without ``received``
    (dummy runs, profiling, capture) the buffers' first ``num_tokens`` rows go
    as they are, and a sequence-parallel model narrows them itself: to the
    same leading rows a real step writes, where captured graphs read.
    """
    if received is None:
        return buffers[:num_tokens]
    rows = received_num_rows(received, num_tokens)
    for key, tensor in received.items():
        buffers[key][:rows].copy_(tensor[:rows], non_blocking=True)
    return buffers[:rows]


def narrow_to_sequence_parallel_rows(
    intermediate_tensors: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """The leading SP-shard rows of every received tensor.

    A real step hands the model exactly ``c = ceil(num_tokens / TP)`` rows;
    profiling, dummy runs and CUDA graph capture hand ``num_tokens`` rows of
    full-capacity persistent buffers, whose leading rows are where a real
    step copies received data, so narrowing keeps the captured addresses.
    Any other count means the stages padded this batch differently, and
    slicing it would silently mix rows.
    """
    rows = sequence_parallel_rows(num_tokens)
    for key, tensor in intermediate_tensors.tensors.items():
        if tensor.shape[0] not in (rows, num_tokens):
            raise ValueError(
                f"Received {key} with {tensor.shape[0]} rows for a batch of "
                f"N={num_tokens} tokens at TP={get_tensor_model_parallel_world_size()}"
                f": a sequence-parallel hand-off has ceil(N/TP)={rows} rows "
                f"(or N from full buffers). The stages padded the batch "
                "differently; start every node with the same flags."
            )
    return IntermediateTensors(
        {key: tensor[:rows] for key, tensor in intermediate_tensors.tensors.items()}
    )


def pp_all_gather_overrides(model: nn.Module) -> dict[str, bool] | None:
    """The model's per-key ``all_gather_tensors`` for PP send and receive.

    ``None`` for models that do not declare any, which keeps the transport's
    default of treating every evenly divisible tensor as TP-replicated.
    """
    get_overrides = getattr(
        model, "get_pp_intermediate_tensor_all_gather_overrides", None
    )
    return None if get_overrides is None else get_overrides()
