# SPDX-License-Identifier: Apache-2.0
"""Print what one step of the tiny Kimi K3 communicates, per rank and phase.

    .venv/bin/python -m eval.comm_report --tp 2 --pp 2 --tokens 17 --sp \
        --aux 0,2,3

(``make comm-report COMM_ARGS=...`` from the checkout root.) A user tool on
the test bed of ``tests/sppp_testbed``: it runs the scenario on that bed's
real ranks (CPU, gloo) and prints Markdown: a table of
calls and bytes per rank, phase and operation, and a table of every tensor
that crosses a PP boundary with the shape that actually travels. Bytes are
float64 here; multiply by 1/4 for bf16. What the ranks print while they start
(import warnings of a CPU machine) goes to ``--log``, which the first line
names; the report ends with the end gather the step took.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import apply

if TYPE_CHECKING:
    from tests.sppp_testbed.stages import Scenario, StageResult

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_LOG = PROJECT_DIR / "build" / "comm-report.log"


def patch_state() -> str:
    """Which vLLM the ranks ran, and whether the patch set was applied."""
    import vllm

    report = apply.status(Path(vllm.__file__).parent)
    applied = (
        f"k3-sppp revision {report['revision']} applied"
        if report["state"] == "applied"
        else "unpatched"
    )
    return f"vLLM {vllm.__version__}, {applied}"


def render(scenario: Scenario, tp: int, results: list[StageResult]) -> str:
    sp_on = sorted({r.sequence_parallel for r in results})
    lines = [
        f"### TP{tp}×PP{len(results) // tp}, {scenario}",
        "",
        f"{patch_state()}; SP in effect: {', '.join(map(str, sp_on))}",
        "",
        "| rank | stage layers | phase | op | calls | bytes |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for rank, result in enumerate(results):
        layers = f"{result.layers[0]}–{result.layers[1] - 1}"
        for (phase, op), (calls, nbytes) in result.ledger.summary().items():
            lines.append(
                f"| {rank} | {layers} | {phase} | {op} | {calls} | {nbytes:,} |"
            )
    lines += [
        "",
        "| rank | direction | key | shape on the wire | bytes |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for rank, result in enumerate(results):
        for record in result.ledger.records:
            if record.op in ("pp_send", "pp_recv"):
                lines.append(
                    f"| {rank} | {record.op[3:]} | {record.key} | "
                    f"{tuple(record.shape)} | {record.nbytes:,} |"
                )
    lines += ["", *boundary_comparison(results, tp)]
    if scenario.drafter == "mtp":
        lines += ["", mtp_path(results[-1])]
    return "\n".join(lines) + "\n"


def boundary_comparison(results: list[StageResult], tp: int) -> list[str]:
    """Per rank: what each PP boundary and the end cost, measured, against
    what gathering SP shards before the hand-off would cost.

    That alternative (a model without the transport overrides, made correct)
    all-gathers each SP key inside TP on the sender, sends a 1/TP slice of
    the full rows (the same bytes as the shard) and all-gathers it again on
    the receiver: two TP all-gathers per key per boundary. Its figures are
    derived from the measured send records, not run.
    """
    lines = [
        "Per rank; all-gather bytes are each call's input. Gather-before-send "
        "is derived from the measured sends: one TP all-gather per key on each "
        "side of the boundary, the same bytes sent.",
        "",
        "| where | rank | keys | this patch set: TP collectives | "
        "all-gather bytes | PP bytes sent | gather-before-send: TP collectives "
        "| all-gather bytes | PP bytes sent |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pp = len(results) // tp
    for stage in range(pp - 1):
        for tp_rank in range(tp):
            sender = results[stage * tp + tp_rank].ledger.records
            receiver = results[(stage + 1) * tp + tp_rank].ledger.records
            sent = [r for r in sender if r.op == "pp_send"]
            hand_off = [
                r
                for r in sender + receiver
                if r.phase.startswith("PP") and not r.op.startswith("pp_")
            ]
            nbytes = sum(r.nbytes for r in sent)
            lines.append(
                f"| boundary {stage}→{stage + 1} | {stage * tp + tp_rank} | "
                f"{len(sent)} | {len(hand_off)} | "
                f"{sum(r.nbytes for r in hand_off):,} | {nbytes:,} | "
                f"{2 * len(sent)} | {2 * nbytes:,} | {nbytes:,} |"
            )
    for tp_rank in range(tp):
        rank = (pp - 1) * tp + tp_rank
        end = [r for r in results[rank].ledger.records if r.phase == "stage output"]
        calls, nbytes = len(end), sum(r.nbytes for r in end)
        lines.append(
            f"| end of the last stage | {rank} | – | {calls} | {nbytes:,} | – | "
            f"{calls} | {nbytes:,} | – |"
        )
    lines += ["", end_gather_path(results[-1])]
    return lines


def end_gather_path(last: StageResult) -> str:
    """Which end gather the last stage took, by what it recorded."""
    gathers = [r for r in last.ledger.records if r.phase == "stage output"]
    if not last.sequence_parallel:
        return "End of the model: no SP, nothing to gather."
    limit = f"PACKED_GATHER_MAX_BYTES = {last.packed_gather_max_bytes:,} B"
    shard = sum(r.nbytes for r in gathers)
    if len(gathers) == 1 and len(last.aux_hidden_states or []) > 0:
        return (
            f"End gather: packed, one all-gather of the {shard:,}-byte shard of "
            f"final and aux states ({limit})."
        )
    if len(gathers) == 1:
        return f"End gather: one all-gather of the final states ({shard:,} B)."
    return (
        f"End gather: {len(gathers)} separate all-gathers, the {shard:,}-byte "
        f"shard being above {limit}."
    )


def mtp_path(last: StageResult) -> str:
    """How the MTP layer on the last stage ran, by what it recorded."""
    records = [r for r in last.ledger.records if r.phase == "drafter"]
    collectives = [r for r in records if r.op != "sp_shard"]
    shards = [r for r in records if r.op == "sp_shard"]
    if not last.drafter_sequence_parallel:
        return (
            f"MTP layer: replicated, {len(collectives)} TP collectives, "
            "no shard and no gather."
        )
    end = collectives[-1]
    return (
        f"MTP layer: sequence parallel, {len(shards)} shard of "
        f"{shards[0].shape[0]} rows, {len(collectives)} TP collectives, the "
        f"last an {end.op} of the {end.shape[0]}-row shard ({end.nbytes:,} B)."
    )


def run_ranks(tp: int, pp: int, scenario: Scenario) -> list[StageResult]:
    """One step on ``tp * pp`` ranks, their shared memory released after it."""
    from tests.sppp_testbed.launcher import RankPool
    from tests.sppp_testbed.stages import run_step
    from vllm.distributed import destroy_model_parallel

    pool = RankPool(tp, pp)
    try:
        results = pool.run(run_step, scenario)
        # The pool kills its ranks; each TP group's broadcaster (vLLM's shared
        # memory ring, made by the group's first rank) would outlive them, and
        # the resource tracker would warn at exit. vLLM's teardown unlinks it.
        pool.run(destroy_model_parallel)
    finally:
        pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="TP size (ranks per stage)")
    parser.add_argument("--pp", type=int, default=2, help="PP size (stages)")
    parser.add_argument("--tokens", type=int, default=17, help="tokens in the step (N)")
    parser.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for sequence parallelism (the MegaMoE + EP + TP > 1 setup)",
    )
    parser.add_argument(
        "--attn-res", action="store_true", help="the attention-residual variant"
    )
    parser.add_argument(
        "--aux",
        default="0,2,3",
        help="aux hidden-state layers, comma-separated ('' for none)",
    )
    parser.add_argument(
        "--packed-gather-max-bytes",
        type=int,
        help="override PACKED_GATHER_MAX_BYTES (a tiny step packs below 40 MiB)",
    )
    parser.add_argument(
        "--production-flags",
        action="store_true",
        help="the seed's VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT=1 and "
        "VLLM_MOE_SKIP_PADDING=1, with a padding mask in the forward context",
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="run vLLM's Kimi K3 MTP layer on the last stage after the target",
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
        f"comm-report: TP{args.tp}×PP{args.pp} ranks on the CPU; their start-up "
        f"output goes to {args.log}",
        file=sys.stderr,
        flush=True,
    )
    try:
        from tests.sppp_testbed.launcher import printing_to

        args.log.write_text("")  # this run's output only
        with printing_to(str(args.log)):
            from tests.sppp_testbed.stages import Scenario

            scenario = Scenario(
                sp=args.sp,
                num_tokens=args.tokens,
                attn_res=args.attn_res,
                aux_layers=tuple(int(x) for x in args.aux.split(",") if x),
                production_flags=args.production_flags,
                packed_gather_max_bytes=args.packed_gather_max_bytes,
                drafter="mtp" if args.mtp else "",
            )
            results = run_ranks(args.tp, args.pp, scenario)
            report = render(scenario, args.tp, results)
    except BaseException:
        print(
            f"comm-report: failed; the ranks' output is in {args.log}", file=sys.stderr
        )
        raise
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
