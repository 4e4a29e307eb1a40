"""What a PP step asks of the model's hand-off declaration, on the host.

The worker and both runners take the model's declaration once, when the
model is loaded (``get_pp_hand_off_declaration``): a step reads the kept
all-gather overrides on its receive and send (an attribute read) and calls
the kept row rule (``expected_rows``), which ``hand_over_intermediate_tensors``
checks (``accepts_hand_off``) before the copy. This times them with
``timeit`` (best of ``--repeat`` runs), beside taking the declaration (once
at load) and the whole hand-over of a decode-sized step. Kimi K3's own
classes answer, built without weights.

    .venv/bin/python -m eval.hand_over_cost [--tokens 64] [--tp 8]
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable


def best_us(call: Callable[[], object], number: int, repeat: int) -> float:
    """Microseconds per call, the best of ``repeat`` runs of ``number``."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def measurements(
    tokens: int, tp: int, number: int, repeat: int
) -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from torch import nn

    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.models.kimi_k3.nvidia import model as k3
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.pp_intermediate_tensors import (
        accepts_hand_off,
        hand_over_intermediate_tensors,
    )

    text = object.__new__(k3.KimiLinearModel)
    nn.Module.__init__(text)
    text.use_sequence_parallel = True
    text.aux_hidden_state_layers = ()
    causal_lm = object.__new__(k3.KimiLinearForCausalLM)
    nn.Module.__init__(causal_lm)
    causal_lm.model = text
    wrapper = object.__new__(k3.KimiK3ForConditionalGeneration)
    nn.Module.__init__(wrapper)
    wrapper.language_model = causal_lm
    other = nn.Linear(2, 2)  # a model that declares nothing

    rows = -(-tokens // tp)
    keys = ("hidden_states", "residual")
    hidden = 7168  # Kimi K3's hidden size
    buffers = IntermediateTensors(
        {k: torch.zeros(8192, hidden, dtype=torch.bfloat16) for k in keys}
    )
    received = IntermediateTensors(
        {k: torch.zeros(rows, hidden, dtype=torch.bfloat16) for k in keys}
    )
    # No process group here: the model's TP size is this run's --tp.
    saved = k3.get_tensor_model_parallel_world_size
    k3.get_tensor_model_parallel_world_size = lambda: tp
    try:
        kept_by = {
            "the K3 multimodal wrapper": get_pp_hand_off_declaration(wrapper),
            "the K3 causal LM": get_pp_hand_off_declaration(causal_lm),
            "a model that declares nothing": get_pp_hand_off_declaration(other),
        }
        cases: list[tuple[str, Callable[[], object]]] = [
            (
                f"expected_rows, per step, kept from {name}",
                lambda kept=kept: kept.expected_rows(tokens),
            )
            for name, kept in kept_by.items()
        ]
        kept = kept_by["the K3 multimodal wrapper"]
        cases += [
            (
                "accepts_hand_off, per step",
                lambda: accepts_hand_off(rows, tokens, rows),
            ),
            (
                "get_pp_hand_off_declaration, once at load, K3 multimodal wrapper",
                lambda: get_pp_hand_off_declaration(wrapper),
            ),
            (
                f"hand_over_intermediate_tensors, whole call "
                f"({rows} rows x {hidden} bf16, 2 keys, CPU copy)",
                lambda: hand_over_intermediate_tensors(buffers, received, tokens, kept),
            ),
        ]
        return [(name, best_us(call, number, repeat)) for name, call in cases]
    finally:
        k3.get_tensor_model_parallel_world_size = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens N of the step")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size")
    parser.add_argument("--number", type=int, default=2000, help="calls per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is kept")
    args = parser.parse_args(argv)
    for name, us in measurements(args.tokens, args.tp, args.number, args.repeat):
        print(f"{us:9.2f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
