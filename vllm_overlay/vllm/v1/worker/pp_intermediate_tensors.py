# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a model runner hands the model on a non-first pipeline-parallel stage.

A model may keep its stage outputs sequence parallel: each TP rank then sends
and receives its ``ceil(N / TP)``-row shard instead of ``N`` rows. Runners
check every received hand-off against the rows the model declares for the
step (at least ``N`` for a model that declares none, as before) and size
their persistent hand-off buffers by the same declaration: a shard's rows
for the runner's capacity, never rows no step writes.
"""

from vllm.model_executor.models.interfaces import PPHandOffDeclaration
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


def hand_off_rows(num_tokens: int, hand_off: PPHandOffDeclaration) -> int:
    """Rows of a PP hand-off for a step of ``num_tokens`` tokens: the rows
    the model declares (its shard under sequence parallelism), else
    ``num_tokens``. Runners size persistent hand-off buffers with it for
    their capacity, so memory no step writes goes to the KV cache instead."""
    expected = hand_off.expected_rows(num_tokens)
    return num_tokens if expected is None else expected


def accepts_hand_off(rows: int, num_tokens: int, expected: int | None) -> bool:
    """Whether a stage that dispatches ``num_tokens`` tokens can take a
    hand-off of ``rows`` rows: exactly the rows its model declares, or, for a
    model that declares none, at least ``num_tokens`` (an earlier stage may
    pad a batch further; the runner then takes the first ``num_tokens``)."""
    if expected is None:
        return rows >= num_tokens
    return rows == expected


def hand_over_intermediate_tensors(
    buffers: IntermediateTensors,
    received: IntermediateTensors | None,
    num_tokens: int,
    hand_off: PPHandOffDeclaration,
) -> IntermediateTensors:
    """What a runner hands the model on a non-first PP stage.

    A real step checks the received rows against what the model expects for
    ``num_tokens`` before copying them into the leading rows of the
    persistent ``buffers``, and hands exactly those rows: ``hand_off`` is
    the model's declaration, which the runner took when it loaded the model.
    Checking here, not in the model, covers CUDA graph replays too. Without
    ``received`` (dummy runs, profiling, warm-up, capture) the buffers'
    leading ``hand_off_rows`` rows go as they are: the rows and addresses a
    real step hands, so captured graphs read where real steps write, and
    the buffers need no more rows than the model declares for the runner's
    capacity.
    """
    if received is None:
        return buffers[: hand_off_rows(num_tokens, hand_off)]
    rows = intermediate_tensors_num_rows(received)
    expected = hand_off.expected_rows(num_tokens)
    if not accepts_hand_off(rows, num_tokens, expected):
        raise ValueError(
            f"Received PP intermediate tensors of {rows} rows for a step of "
            f"{num_tokens} tokens where this stage expects "
            f"{f'at least {num_tokens}' if expected is None else expected}: "
            "the stages padded the batch differently. Start every node with "
            "the same --compilation-config, --max-cudagraph-capture-size, "
            "--enforce-eager and --speculative-config."
        )
    if expected is None:
        rows = num_tokens
    for key, tensor in received.items():
        buffers[key][:rows].copy_(tensor[:rows], non_blocking=True)
    return buffers[:rows]
