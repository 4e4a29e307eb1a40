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

With SP across stages it runs the step a second time in the test bed's
replicated hand-off (vLLM 0.34.0's way for DeepSeek V4.1 and MiniMax-M3:
gather before the send, re-shard on the receiver) and sets the two layouts
side by side, per rank: TP collectives and their bytes at each PP boundary
and at the end. A second table does so per N: measured on the ranks for
``--sweep`` (the test bed's budget, 127 tokens, is the most a step takes),
derived for ``--derive`` from a rule the measured points are checked
against, and marked as derived.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import apply

if TYPE_CHECKING:
    from tests.sppp_testbed.stages import Scenario, StageResult

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_LOG = PROJECT_DIR / "build" / "comm-report.log"

# The two layouts of an SP hand-off, by the test bed's Scenario.handoff.
LAYOUTS = {
    "sharded": "shard-to-shard (this series)",
    "replicated": "replicated hand-off (0.34.0's way)",
}
TP_OPS = ("all_gather", "reduce_scatter", "all_reduce")
# N the per-N table derives above the test bed's budget (127 tokens a step).
DERIVED_TOKENS = "256,1024,4096,16384,32768"
# Kimi K3 in production: hidden 7168, bf16.
K3_HIDDEN, K3_ITEMSIZE = 7168, 2


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


def render(
    scenario: Scenario,
    tp: int,
    runs: dict[str, list[StageResult]],
    sweep: list[Point] | None = None,
    derive: list[int] | None = None,
) -> str:
    """The report: ``runs`` holds the step per layout (the series' first),
    ``sweep`` the per-N measurements of both layouts."""
    results = runs["sharded"]
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
    if "replicated" in runs:
        lines += ["", *side_by_side(runs, tp)]
        if sweep:
            shape = step_shape(results)
            lines += ["", *per_n_table(sweep, shape, tp, derive or [])]
    else:
        lines += ["", "One layout only: without SP across stages both hand off alike."]
    lines += ["", end_gather_path(results[-1])]
    if scenario.drafter == "mtp":
        lines += ["", mtp_path(results[-1])]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Cost:
    """What one rank spends at one place of a step: TP collectives and the
    bytes of their inputs, PP bytes on the wire (sent or received), and local
    re-shards (``sp_shard``, no bytes)."""

    collectives: int = 0
    collective_bytes: int = 0
    pp_bytes: int = 0
    shards: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.collectives + other.collectives,
            self.collective_bytes + other.collective_bytes,
            self.pp_bytes + other.pp_bytes,
            self.shards + other.shards,
        )


def cost_of(result: StageResult, phase: str) -> Cost:
    """What ``result``'s ledger recorded in ``phase``."""
    records = [r for r in result.ledger.records if r.phase == phase]
    collectives = [r for r in records if r.op in TP_OPS]
    return Cost(
        len(collectives),
        sum(r.nbytes for r in collectives),
        sum(r.nbytes for r in records if r.op.startswith("pp_")),
        sum(r.op == "sp_shard" for r in records),
    )


def places(results: list[StageResult], tp: int) -> list[tuple[int, str, Cost]]:
    """Per rank, in rank order: (rank, place, cost) for the boundary it
    receives from, the boundary it sends to and, on the last stage, the end."""
    pp = len(results) // tp
    rows = []
    for rank, result in enumerate(results):
        stage = rank // tp
        if stage > 0:
            rows.append(
                (rank, f"receive {stage - 1}→{stage}", cost_of(result, "PP recv"))
            )
        if stage < pp - 1:
            rows.append((rank, f"send {stage}→{stage + 1}", cost_of(result, "PP send")))
        else:
            rows.append(
                (rank, "end of the last stage", cost_of(result, "stage output"))
            )
    return rows


def cost_cells(cost: Cost) -> str:
    return f"{cost.collectives} | {cost.collective_bytes:,} | {cost.pp_bytes:,}"


def side_by_side(runs: dict[str, list[StageResult]], tp: int) -> list[str]:
    """Per rank and place, measured in both layouts."""
    series, replicated = (places(runs[name], tp) for name in LAYOUTS)
    lines = [
        f"Side by side, measured on these ranks: {LAYOUTS['sharded']} against "
        f"the {LAYOUTS['replicated']}: each non-last stage all-gathers its "
        "shards before the send, the transport sends a 1/TP slice and "
        "all-gathers it on the receiver, which shards again (local). Per rank "
        "and step; collective bytes are each call's input, PP bytes what "
        "crosses the wire.",
        "",
        "| rank | place | series: TP collectives | collective bytes | PP bytes "
        "| replicated: TP collectives | collective bytes | PP bytes | re-shards |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    totals = {name: Cost() for name in LAYOUTS}
    for (rank, place, ours), (_, _, theirs) in zip(series, replicated, strict=True):
        for name, cost in (("sharded", ours), ("replicated", theirs)):
            if place.startswith("receive"):  # its PP bytes are counted as sent
                cost = dataclasses.replace(cost, pp_bytes=0)
            totals[name] += cost
        lines.append(
            f"| {rank} | {place} | {cost_cells(ours)} | {cost_cells(theirs)} "
            f"| {theirs.shards} |"
        )
    ours, theirs = totals["sharded"], totals["replicated"]
    lines.append(
        f"| all | step, all ranks (PP bytes as sent) | {cost_cells(ours)} "
        f"| {cost_cells(theirs)} | {theirs.shards} |"
    )
    return lines


@dataclass(frozen=True)
class Point:
    """One N measured in both layouts: boundary 0→1 per TP rank (sender's
    send and receiver's receive) and the end, each the same on every TP rank
    (``alike`` says whether it was)."""

    n: int
    boundary: dict[str, Cost]
    end: dict[str, Cost]
    alike: bool


def measured_point(n: int, runs: dict[str, list[StageResult]], tp: int) -> Point:
    boundary, end, alike = {}, {}, True
    for name, results in runs.items():
        pairs = {hand_off(results[r], results[tp + r]) for r in range(tp)}
        ends = {cost_of(result, "stage output") for result in results[-tp:]}
        alike = alike and len(pairs) == len(ends) == 1
        boundary[name], end[name] = max(pairs, key=astuple), max(ends, key=astuple)
    return Point(n, boundary, end, alike)


def hand_off(sender: StageResult, receiver: StageResult) -> Cost:
    """One TP rank's boundary: both sides' collectives and re-shards, the
    PP bytes once (as sent)."""
    sent, received = cost_of(sender, "PP send"), cost_of(receiver, "PP recv")
    return Cost(
        sent.collectives + received.collectives,
        sent.collective_bytes + received.collective_bytes,
        sent.pp_bytes,
        sent.shards + received.shards,
    )


def arriving(cost: Cost, tp: int) -> int:
    """Bytes that arrive at the ranks: a TP all-gather brings each rank the
    other TP - 1 ranks' inputs; a PP transfer its payload."""
    return (tp - 1) * cost.collective_bytes + cost.pp_bytes


def astuple(cost: Cost) -> tuple[int, int, int, int]:
    return (cost.collectives, cost.collective_bytes, cost.pp_bytes, cost.shards)


@dataclass(frozen=True)
class StepShape:
    """What a step's hand-off and end are made of, read off a measured step:
    the elements per row of each key crossing boundary 0→1, how many states
    the end gathers, the hidden size, the element size, the packing limit."""

    widths: tuple[int, ...]
    end_states: int
    hidden: int
    itemsize: int
    packed_limit: int


def step_shape(results: list[StageResult]) -> StepShape:
    """From the series' step: its boundary 0→1 sends and last stage."""
    sent = [r for r in results[0].ledger.records if r.op == "pp_send"]
    last = results[-1]
    return StepShape(
        widths=tuple(math.prod(r.shape[1:]) for r in sent),
        end_states=1 + len(last.aux_hidden_states or []),
        hidden=last.hidden_states.shape[-1],
        itemsize=last.hidden_states.element_size(),
        packed_limit=last.packed_gather_max_bytes,
    )


def rule(shape: StepShape, n: int, tp: int) -> Point:
    """Both layouts at ``n`` tokens, by the rule the code follows.

    Series: each key sent once as the ``c``-row shard, no TP collective.
    Replicated: one packed all-gather of the shards on the sender; vLLM's
    transport sends a 1/TP slice of each ``n``-row key whose elements TP
    divides (the whole key otherwise) and all-gathers the slices on the
    receiver, which shards each key locally. End, both: one packed
    all-gather of every state's shard up to the packing limit, one per state
    above it.
    """
    rows, e = -(-n // tp), shape.itemsize
    shard = rows * sum(shape.widths) * e
    sliced = [w for w in shape.widths if n * w % tp == 0]
    slice_bytes = sum(n * w // tp for w in sliced) * e
    whole_bytes = sum(n * w for w in shape.widths if n * w % tp) * e
    end_bytes = shape.end_states * rows * shape.hidden * e
    packed = shape.end_states == 1 or end_bytes <= shape.packed_limit
    end = Cost(1 if packed else shape.end_states, end_bytes)
    return Point(
        n,
        boundary={
            "sharded": Cost(0, 0, shard),
            "replicated": Cost(
                1 + len(sliced),
                shard + slice_bytes,
                slice_bytes + whole_bytes,
                len(shape.widths),
            ),
        },
        end={"sharded": end, "replicated": end},
        alike=True,
    )


def per_n_table(
    sweep: list[Point], shape: StepShape, tp: int, derive: list[int]
) -> list[str]:
    """Boundary 0→1 and the end per N: measured, then derived by ``rule``
    where every measured point agrees with it."""
    misses = [
        f"N={p.n}"
        for p in sweep
        if (p.boundary, p.end) != _figures(rule(shape, p.n, tp))
    ]
    rows = [(p, "measured") for p in sweep]
    if misses:
        note = (
            f"The rule misses the measured points at {', '.join(misses)}: "
            "nothing is derived."
        )
    else:
        rows += [(rule(shape, n, tp), "**derived**") for n in derive]
        note = (
            "The rule gives every measured point exactly; rows marked "
            "**derived** come from it, not from a run."
        )
    scale = K3_HIDDEN * K3_ITEMSIZE / (shape.hidden * shape.itemsize)
    lines = [
        f"Per N, TP{tp}: boundary 0→1 per TP rank (the sender's send and the "
        "receiver's receive; PP bytes as sent) and the end of the last stage. "
        "Bytes arriving: what the boundary brings its two ranks, TP - 1 times "
        "each all-gather's input plus the PP payload. " + note + " Kimi K3 "
        f"(hidden {K3_HIDDEN}, bf16) moves {scale:g}× these bytes, with the "
        "same collectives at the boundary and, while that many end bytes stay "
        "within PACKED_GATHER_MAX_BYTES, at the end (one gather per state "
        "above it).",
        "",
        "| N | rows c | figures | series: boundary TP collectives | collective "
        "bytes | PP bytes | replicated: boundary TP collectives | collective "
        "bytes | PP bytes | replicated / series, bytes arriving | end, series: TP "
        "collectives | bytes | end, replicated: TP collectives | bytes |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |",
    ]
    for point, figures in rows:
        ours, theirs = point.boundary["sharded"], point.boundary["replicated"]
        moved = [arriving(c, tp) for c in (ours, theirs)]
        if not point.alike:
            figures += ", largest of unequal TP ranks"
        lines.append(
            f"| {point.n} | {-(-point.n // tp)} | {figures} | {cost_cells(ours)} "
            f"| {cost_cells(theirs)} | {moved[1] / moved[0]:.2f}× "
            f"| {point.end['sharded'].collectives} "
            f"| {point.end['sharded'].collective_bytes:,} "
            f"| {point.end['replicated'].collectives} "
            f"| {point.end['replicated'].collective_bytes:,} |"
        )
    return lines


def _figures(point: Point) -> tuple[dict[str, Cost], dict[str, Cost]]:
    return point.boundary, point.end


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


def run_ranks(
    tp: int, pp: int, scenarios: list[Scenario], progress=sys.stderr
) -> list[list[StageResult]]:
    """Each scenario's step on the same ``tp * pp`` ranks, a line on
    ``progress`` after each; their shared memory released after the last."""
    from tests.sppp_testbed.launcher import RankPool
    from tests.sppp_testbed.stages import run_step
    from vllm.distributed import destroy_model_parallel

    pool = RankPool(tp, pp)
    try:
        runs = []
        for done, scenario in enumerate(scenarios, start=1):
            runs.append(pool.run(run_step, scenario))
            print(
                f"comm-report: step {done}/{len(scenarios)} ({scenario}) done",
                file=progress,
                flush=True,
            )
        # The pool kills its ranks; each TP group's broadcaster (vLLM's shared
        # memory ring, made by the group's first rank) would outlive them, and
        # the resource tracker would warn at exit. vLLM's teardown unlinks it.
        pool.run(destroy_model_parallel)
    finally:
        pool.close()
    return runs


def token_list(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def default_sweep(tp: int) -> str:
    """N = 1, below TP, not divisible by TP, 17, 64 and the test bed's whole
    budget (127 tokens)."""
    return ",".join(map(str, sorted({1, max(tp - 1, 1), tp + 1, 17, 64, 127})))


def run_report(scenario: Scenario, args: argparse.Namespace, progress) -> str:
    """The step in each layout, the sweep's steps in both, and the report.

    The second layout runs only where it differs: SP across stages."""
    layouts = list(LAYOUTS) if args.sp and args.pp > 1 else ["sharded"]
    sweep = token_list(args.sweep) if len(layouts) == 2 else []
    steps = [dataclasses.replace(scenario, handoff=name) for name in layouts]
    steps += [
        dataclasses.replace(scenario, num_tokens=n, handoff=name, drafter="")
        for n in sweep
        for name in layouts
    ]
    results = run_ranks(args.tp, args.pp, steps, progress)
    runs = dict(zip(layouts, results, strict=False))
    measured = iter(results[len(layouts) :])
    points = [
        measured_point(n, {name: next(measured) for name in layouts}, args.tp)
        for n in sweep
    ]
    return render(scenario, args.tp, runs, points, token_list(args.derive))


@contextlib.contextmanager
def terminal() -> Iterator[TextIO]:
    """Where stderr goes now, kept open while the ranks' output is moved to
    the log: the progress lines' destination."""
    try:
        descriptor = os.dup(sys.stderr.fileno())
    except OSError:  # a stream without a descriptor (a test's capture)
        yield sys.stderr
        return
    with os.fdopen(descriptor, "w", buffering=1) as stream:
        yield stream


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
        "--sweep",
        help="N to measure in both layouts for the per-N table, comma-separated "
        "(default: 1, TP-1, TP+1, 17, 64, 127; '' for none)",
    )
    parser.add_argument(
        "--derive",
        default=DERIVED_TOKENS,
        help="N the per-N table derives from the rule, above the test bed's "
        "budget (default: %(default)s)",
    )
    parser.add_argument(
        "--log",
        type=Path,
        default=DEFAULT_LOG,
        help="where the ranks' start-up output goes (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.sweep is None:
        args.sweep = default_sweep(args.tp)
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
        with terminal() as progress, printing_to(str(args.log)):
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
            report = run_report(scenario, args, progress)
    except BaseException:
        print(
            f"comm-report: failed; the ranks' output is in {args.log}", file=sys.stderr
        )
        raise
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
