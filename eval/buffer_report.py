# SPDX-License-Identifier: Apache-2.0
"""Bytes each rank keeps in its PP hand-off buffers, before and after issue 54.

    .venv/bin/python -m eval.buffer_report --tp 2 --pp 2

(``make buffer-report BUFFER_ARGS=...``, beside ``make comm-report``.) On the
test bed's real ranks (CPU, gloo) every rank builds its stage of the tiny
Kimi K3 and allocates what Model Runner V2 keeps for the hand-off, with the
runner's own calls: the receive buffers of a non-first stage
(``make_empty_intermediate_tensors``, with the EAGLE-3 aux slots where aux
layers are set) and the CUDA graph capture outputs of a non-last stage
(``persistent_like`` of the stage's output on a dummy run of the widest
graph). "Before" sizes them for the runner's capacity (``max_num_tokens``
rows, the widest graph's tokens), as 0.34.0 does; "after" with the series'
``hand_off_rows``: the model's declared rows, ``ceil(capacity/TP)`` under SP.

A second table derives the same at Kimi K3's production shape from the
formula it prints (hidden 7168, 93 layers, bf16, TP8×PP2, 32768 batched
tokens, the seed's ``--max-cudagraph-capture-size 128``), per AttnRes block
size, and the KV cache blocks that memory buys under the assumptions it
names. Bytes on the ranks are float64 (the test bed's dtype).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_LOG = PROJECT_DIR / "build" / "buffer-report.log"

# Kimi K3 in production (eval/comm_report.py, the seed's serve command).
K3_HIDDEN, K3_LAYERS, K3_ITEMSIZE = 7168, 93, 2
K3_TP, K3_PP, K3_BATCHED_TOKENS, K3_WIDEST_GRAPH = 8, 2, 32768, 128
# MLA's fp8 KV cache with scales, per token and layer (vLLM's figure for that
# format, v1/attention/backend.py), and its block size.
MLA_FP8_TOKEN_BYTES, KV_BLOCK_TOKENS = 656, 64


@dataclass(frozen=True)
class Request:
    """What every rank builds and sizes."""

    sp: bool
    attn_res: bool
    aux_layers: tuple[int, ...]
    widest_graph: int


@dataclass(frozen=True)
class RankBuffers:
    """One rank's hand-off buffers in bytes, as 0.34.0 and as the series
    size them: receive buffers (non-first stages), capture outputs
    (non-last stages)."""

    layers: tuple[int, int]
    sequence_parallel: bool
    receive: tuple[int, int] = (0, 0)
    capture: tuple[int, int] = (0, 0)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.tensors.values())


def persistent_like(x, rows: int):
    """The V2 graph manager's capture-output allocation (``capture``)."""
    return x.new_empty((max(rows, x.shape[0]), *x.shape[1:]))


def rank_buffers(request: Request) -> RankBuffers:
    """Run in every rank: build the stage and size its hand-off buffers."""
    import types

    import torch

    from tests.sppp_testbed import stages
    from tests.sppp_testbed.tiny_k3 import build_model, scenario_config, stand_ins
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.model_executor.models.interfaces import get_pp_hand_off_declaration
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        reserve_aux_intermediate_tensor_slots,
    )
    from vllm.v1.worker.pp_intermediate_tensors import hand_off_rows

    tp, pp = get_tp_group().world_size, get_pp_group()
    config = scenario_config(
        tp, pp.world_size, sp=request.sp, attn_res=request.attn_res
    )
    capacity = stages.RUNNER_CAPACITY
    with set_current_vllm_config(config), stand_ins(), torch.no_grad():
        model = build_model(config, 0)
        if request.aux_layers:
            model._set_aux_hidden_state_layers(request.aux_layers)
        hand_off = get_pp_hand_off_declaration(model)
        result = {
            "layers": (model.start_layer, model.end_layer),
            "sequence_parallel": model.use_sequence_parallel,
        }
        if not pp.is_first_rank:
            # The runner's view: aux relay slots reserved in its buffers.
            runner_model = types.SimpleNamespace(
                model=model,
                make_empty_intermediate_tensors=model.make_empty_intermediate_tensors,
            )
            reserve_aux_intermediate_tensor_slots(runner_model)
            result["receive"] = tuple(
                nbytes(
                    runner_model.make_empty_intermediate_tensors(
                        rows, torch.get_default_dtype(), torch.device("cpu")
                    )
                )
                for rows in (capacity, hand_off_rows(capacity, hand_off))
            )
        if not pp.is_last_rank:
            widest = request.widest_graph
            inputs = stages.dummy_run_inputs(model, widest, 0)
            ids = torch.zeros(widest, dtype=torch.long)
            output = model(ids, torch.arange(widest), inputs)
            result["capture"] = tuple(
                sum(persistent_like(v, rows).nbytes for v in output.tensors.values())
                for rows in (widest, hand_off_rows(widest, hand_off))
            )
    return RankBuffers(**result)


def measure(tp: int, pp: int, *requests: Request) -> list[list[RankBuffers]]:
    """Every rank's buffers for each request, on one pool of ranks."""
    from tests.sppp_testbed.launcher import RankPool
    from vllm.distributed import destroy_model_parallel

    pool = RankPool(tp, pp)
    try:
        found = [pool.run(rank_buffers, request) for request in requests]
        # vLLM's teardown unlinks each TP group's shared-memory broadcaster.
        pool.run(destroy_model_parallel)
    finally:
        pool.close()
    return found


def measured_table(tp: int, pp: int, request: Request, ranks: list[RankBuffers]):
    from tests.sppp_testbed.stages import RUNNER_CAPACITY

    lines = [
        f"### TP{tp}×PP{pp}, measured on the ranks (float64): "
        f"capacity {RUNNER_CAPACITY} tokens, widest graph {request.widest_graph}"
        f"{', AttnRes' if request.attn_res else ''}"
        f"{f', aux {list(request.aux_layers)}' if request.aux_layers else ''}",
        "",
        "| rank | stage layers | SP | receive buffers before → after (B) "
        "| capture outputs before → after (B) | saved (B) |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for rank, r in enumerate(ranks):
        saved = r.receive[0] - r.receive[1] + r.capture[0] - r.capture[1]
        lines.append(
            f"| {rank} | {r.layers[0]}–{r.layers[1] - 1} | {r.sequence_parallel} "
            f"| {r.receive[0]:,} → {r.receive[1]:,} "
            f"| {r.capture[0]:,} → {r.capture[1]:,} | {saved:,} |"
        )
    return lines


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stage_starts(layers: int, pp: int) -> list[int]:
    """vLLM's default split (``get_pp_indices``): the remainder goes to the
    stages before the last."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return [sum(parts[:i]) for i in range(pp + 1)]


def derived_table(block_sizes: list[int], mla_layers: int) -> list[str]:
    """The production figures, from the formula (no drafter: no aux slots)."""
    gib = 1024**3
    starts = stage_starts(K3_LAYERS, K3_PP)
    boundary = starts[1]
    row = K3_HIDDEN * K3_ITEMSIZE
    before_rows, after_rows = K3_BATCHED_TOKENS, cdiv(K3_BATCHED_TOKENS, K3_TP)
    graph_rows = (K3_WIDEST_GRAPH, cdiv(K3_WIDEST_GRAPH, K3_TP))
    kv_block = KV_BLOCK_TOKENS * MLA_FP8_TOKEN_BYTES * mla_layers
    lines = [
        f"### Kimi K3 production, derived: TP{K3_TP}×PP{K3_PP}, bf16, hidden "
        f"{K3_HIDDEN}, {K3_LAYERS} layers split "
        f"{[starts[i + 1] - starts[i] for i in range(K3_PP)]}, "
        f"{K3_BATCHED_TOKENS} batched tokens, widest graph {K3_WIDEST_GRAPH}",
        "",
        f"Stage 1's receive buffers: R · (1 + b) · {K3_HIDDEN} · {K3_ITEMSIZE} B, "
        f"b = ceil({boundary}/B) AttnRes blocks behind layer {boundary} (b = 0 "
        f"without AttnRes), R = {before_rows} before and ceil({before_rows}/"
        f"{K3_TP}) = {after_rows} after. Stage 0's capture outputs: W · (1 + b) "
        f"· {K3_HIDDEN} · {K3_ITEMSIZE} B, W = {graph_rows[0]} before, "
        f"{graph_rows[1]} after. One KV cache block on stage 1: "
        f"{KV_BLOCK_TOKENS} tokens · {MLA_FP8_TOKEN_BYTES} B (MLA fp8 with "
        f"scales) · {mla_layers} MLA layers = {kv_block:,} B (assumed: the "
        "checkpoint's layer kinds are not in this repository; KDA state is "
        "per request, not per block).",
        "",
        "| AttnRes block size B | b | stage 1 receive before → after (GiB) "
        "| stage 0 capture before → after (MiB) | stage 1 gains (GiB per rank) "
        "| KV cache blocks gained per rank |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for block in block_sizes:
        blocks = cdiv(boundary, block) if block else 0
        per_row = (1 + blocks) * row
        receive = (before_rows * per_row, after_rows * per_row)
        capture = (graph_rows[0] * per_row, graph_rows[1] * per_row)
        gained = receive[0] - receive[1]
        lines.append(
            f"| {block or 'no AttnRes'} | {blocks} "
            f"| {receive[0] / gib:.3f} → {receive[1] / gib:.3f} "
            f"| {capture[0] / 2**20:.1f} → {capture[1] / 2**20:.1f} "
            f"| {gained / gib:.3f} | {gained // kv_block:,} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="TP size (ranks per stage)")
    parser.add_argument("--pp", type=int, default=2, help="PP size (stages)")
    parser.add_argument(
        "--sp", action=argparse.BooleanOptionalAction, default=True, help="ask for SP"
    )
    parser.add_argument(
        "--attn-res",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the attention-residual variant (a 3-D residual bank)",
    )
    parser.add_argument(
        "--aux", default="", help="aux hidden-state layers, comma-separated"
    )
    parser.add_argument(
        "--widest-graph",
        type=int,
        default=64,
        help="tokens of the widest CUDA graph (capture outputs; default 64)",
    )
    parser.add_argument(
        "--block-sizes",
        default="0,4,8,12,16",
        help="AttnRes block sizes to derive at the production shape (0: none)",
    )
    parser.add_argument(
        "--mla-layers",
        type=int,
        default=12,
        help="MLA layers on stage 1 for the KV block size (default 12: one in "
        "four of 46, an assumption)",
    )
    parser.add_argument(
        "--log",
        type=Path,
        default=DEFAULT_LOG,
        help="where the ranks' start-up output goes (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    args.log.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"buffer-report: TP{args.tp}×PP{args.pp} ranks on the CPU; their "
        f"start-up output goes to {args.log}",
        file=sys.stderr,
        flush=True,
    )
    from tests.sppp_testbed.launcher import printing_to

    args.log.write_text("")
    request = Request(
        sp=args.sp,
        attn_res=args.attn_res,
        aux_layers=tuple(int(x) for x in args.aux.split(",") if x),
        widest_graph=args.widest_graph,
    )
    with printing_to(str(args.log)):
        (ranks,) = measure(args.tp, args.pp, request)
    lines = measured_table(args.tp, args.pp, request, ranks)
    blocks = [int(x) for x in args.block_sizes.split(",") if x]
    lines += ["", *derived_table(blocks, args.mla_layers)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
