# SPDX-License-Identifier: Apache-2.0
"""Time the two communication patterns SP×PP changes, with torch.distributed only.

(a) ``handoff`` — TP×PP2: hand ``hidden_states`` and ``residual`` from stage 0 to
    stage 1. *sp*: TP rank r sends its ``ceil(N/TP)``-row shard straight to TP
    rank r of the next stage. *replicated*: what a model without the transport
    override costs: all-gather the shards inside TP, send a 1/TP slice of the
    full tensor, all-gather it again on the receiver.
(b) ``gather`` — TP only: the last stage's end gather of the final hidden
    states and ``k`` aux states: one all-gather of ``[final | aux...]`` packed
    along the hidden dimension against ``k + 1`` separate all-gathers.

Each point checks once that both variants deliver the same rows, then times
``--iters`` iterations after ``--warmup``; every iteration starts after a
barrier and its time is the slowest rank's (CUDA events on GPU, a monotonic
clock on CPU). Results go to ``--out`` as JSON (with versions and command)
and a Markdown table of medians and ratios.

    torchrun --nproc-per-node 4 eval/nccl_bench.py --part handoff --tp 2
    torchrun --nproc-per-node 4 eval/nccl_bench.py --part gather --tp 4

On CPU (gloo) it runs the same code at tiny sizes, which is how the tests keep
it from rotting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Timer:
    """Per-iteration wall time of the slowest rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def measure(self, step: Callable[[], object]) -> float:
        dist.barrier()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            step()
            elapsed = time.perf_counter() - begin
        # NCCL reduces device tensors only.
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()


def summarize(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": ordered[len(ordered) // 10] * 1e6,
        "p90_us": ordered[(len(ordered) * 9) // 10] * 1e6,
    }


def time_variants(
    args: argparse.Namespace, device: torch.device, **variants: Callable[[], object]
) -> dict[str, dict[str, float]]:
    """``--warmup`` then ``--iters`` timed runs of each variant, in turn."""
    timer = Timer(device)
    timings = {}
    for name, step in variants.items():
        for _ in range(args.warmup):
            timer.measure(step)
        timings[name] = summarize([timer.measure(step) for _ in range(args.iters)])
    return timings


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def handoff_point(args, n: int, groups, device) -> dict:
    """Stage 0 → stage 1, both variants; returns timings of this point."""
    tp, rank = args.tp, dist.get_rank()
    tp_rank, stage = rank % tp, rank // tp
    tp_group = groups[stage]
    peer = rank + tp if stage == 0 else rank - tp
    rows = ceil_div(n, tp)
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(n)
    full = torch.randn((tp * rows, args.hidden), generator=generator).to(device, dtype)
    shard = full[tp_rank * rows : (tp_rank + 1) * rows]
    tensors = [shard.clone(), (shard * 2).clone()]  # hidden_states, residual

    def sp() -> list[torch.Tensor]:
        out = [torch.empty_like(t) for t in tensors]
        ops = [
            dist.P2POp(dist.isend if stage == 0 else dist.irecv, t, peer)
            for t in (tensors if stage == 0 else out)
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out

    def replicated() -> list[torch.Tensor]:
        if stage == 0:
            slices = [all_gather(t, tp_group).reshape(tp, -1)[tp_rank] for t in tensors]
            ops = [dist.P2POp(dist.isend, s.contiguous(), peer) for s in slices]
        else:
            slices = [
                torch.empty(rows * args.hidden, dtype=dtype, device=device)
                for _ in tensors
            ]
            ops = [dist.P2POp(dist.irecv, s, peer) for s in slices]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if stage == 0:
            return []
        # The receiver rebuilds the full tensor and keeps its own shard rows.
        return [
            all_gather(s, tp_group).reshape(tp * rows, -1)[
                tp_rank * rows : (tp_rank + 1) * rows
            ]
            for s in slices
        ]

    if stage == 1:
        for got, want in zip(sp(), [shard, shard * 2], strict=True):
            assert torch.equal(got, want), f"sp hand-off corrupted rows (N={n})"
        for got, want in zip(replicated(), [shard, shard * 2], strict=True):
            assert torch.equal(got, want), f"replicated hand-off corrupted rows (N={n})"
    else:
        sp()
        replicated()
    result = {"N": n, "rows_per_rank": rows}
    result |= time_variants(args, device, sp=sp, replicated=replicated)
    result["ratio"] = result["replicated"]["median_us"] / result["sp"]["median_us"]
    return result


def gather_point(args, n: int, k: int, device) -> dict:
    tp, rank = dist.get_world_size(), dist.get_rank()
    rows = ceil_div(n, tp)
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(1000 * n + 10 * k + rank)
    parts = [
        torch.randn((rows, args.hidden), generator=generator).to(device, dtype)
        for _ in range(k + 1)
    ]

    def packed() -> list[torch.Tensor]:
        gathered = all_gather(torch.cat(parts, dim=-1), dist.group.WORLD)
        return list(gathered[:n].split(args.hidden, dim=-1))

    def separate() -> list[torch.Tensor]:
        return [all_gather(p, dist.group.WORLD)[:n] for p in parts]

    for got, want in zip(packed(), separate(), strict=True):
        assert torch.equal(got, want), f"packed gather differs (N={n}, k={k})"
    result = {"N": n, "k": k}
    result |= time_variants(args, device, packed=packed, separate=separate)
    result["speedup"] = result["separate"]["median_us"] / result["packed"]["median_us"]
    return result


def markdown(report: dict) -> str:
    lines = [f"# {report['part']}: {report['setup']}", ""]
    if report["part"] == "handoff":
        lines += [
            "| N | rows/rank | sp median µs | replicated median µs | replicated / sp |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in report["points"]:
            lines.append(
                f"| {p['N']} | {p['rows_per_rank']} | {p['sp']['median_us']:.1f} | "
                f"{p['replicated']['median_us']:.1f} | {p['ratio']:.2f}× |"
            )
    else:
        lines += [
            "| N | k aux | packed median µs | separate median µs | separate / packed |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in report["points"]:
            lines.append(
                f"| {p['N']} | {p['k']} | {p['packed']['median_us']:.1f} | "
                f"{p['separate']['median_us']:.1f} | {p['speedup']:.2f}× |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("handoff", "gather"), required=True)
    parser.add_argument("--tp", type=int, default=2, help="handoff: TP size (PP is 2)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", default="", help="comma-separated N values")
    parser.add_argument("--aux", default="1,3", help="gather: comma-separated k")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/nccl"))
    args = parser.parse_args(argv)

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    default_tokens = (
        "128,1024,8192,32768" if args.part == "handoff" else "8,64,256,1024"
    )
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]

    points = []
    if args.part == "handoff":
        if world != 2 * args.tp:
            parser.error(
                f"handoff runs TP{args.tp}×PP2: start {2 * args.tp} ranks, not {world}"
            )
        groups = [
            dist.new_group(list(range(s * args.tp, (s + 1) * args.tp))) for s in (0, 1)
        ]
        setup = f"TP{args.tp}×PP2"
        for n in tokens:
            points.append(handoff_point(args, n, groups, device))
            if rank == 0:
                print(f"handoff N={n}: done", flush=True)
    else:
        setup = f"TP{world}"
        for n in tokens:
            for k in (int(x) for x in args.aux.split(",")):
                points.append(gather_point(args, n, k, device))
                if rank == 0:
                    print(f"gather N={n} k={k}: done", flush=True)
    if rank == 0:
        device_name = (
            torch.cuda.get_device_name(device)
            if cuda
            else platform.processor() or "cpu"
        )
        report = {
            "part": args.part,
            "setup": f"{setup}, {args.dtype}, hidden {args.hidden}, {device_name}, "
            f"{'nccl' if cuda else 'gloo'}, {args.iters} iterations",
            "points": points,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "command": " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"{args.part}-{setup.replace('×', 'x')}-{args.dtype}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(report))
        print(markdown(report), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
