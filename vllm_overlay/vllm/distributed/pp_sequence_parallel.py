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


def narrow_to_sequence_parallel_rows(
    intermediate_tensors: IntermediateTensors, num_tokens: int
) -> IntermediateTensors:
    """The leading SP-shard rows of every received tensor.

    A real step hands the model exactly these rows; profiling, dummy runs and
    CUDA graph capture hand full-capacity persistent buffers, whose leading
    rows are where a real step copies received data, so narrowing keeps the
    captured addresses.
    """
    rows = sequence_parallel_rows(num_tokens)
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
