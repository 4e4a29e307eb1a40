# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a model runner hands the model on a non-first pipeline-parallel stage.

A model may keep its stage outputs sequence parallel: each TP rank then sends
and receives its ``ceil(N / TP)``-row shard instead of ``N`` rows. Runners
take the row count from the tensors that arrived, never from the batch, and
keep their persistent receive buffers at full capacity.
"""

from vllm.sequence import IntermediateTensors


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
