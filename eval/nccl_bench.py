# SPDX-License-Identifier: Apache-2.0
"""Time the communication SP×PP changes, back to back, with torch.distributed only.

Parts (``--part``, comma-separated; each needs only PyTorch):

``gather``
    The last stage's end gather at TP: the final hidden states and ``k`` aux
    states, ``ceil(N/TP)`` rows each per rank. *packed* is what the model does:
    ``torch.cat`` along the hidden dimension, one all-gather, trim to ``N``
    rows, split. *separate* is ``k + 1`` all-gathers of the unpacked tensors,
    each trimmed to ``N``. *packed_nocopy* is packing without the copy: the
    states already lie in one preallocated buffer, so only the gather, trim and
    split are left (what writing them there costs the producers is not timed).
``components``
    The SP hand-off at two GPUs, by its parts: a send of the ``ceil(N/2)``-row
    shards of ``hidden_states`` and ``residual`` from rank 0 to rank 1, and an
    all-gather of the same two shards over both ranks. The hand-off ratio of a
    replicated transport, ``(send + 2 all-gathers) / send``, is derived from
    these, not measured.
``handoff``
    The hand-off itself at TP×PP2 (``2·TP`` ranks), ``hidden_states`` and
    ``residual``: *sp* (the series) sends each shard to the same TP rank of
    the next stage; *replicated* is vLLM 0.34.0's way for DeepSeek V4.1 and
    MiniMax-M3 applied to Kimi K3, step for step as the test bed's
    ``Scenario(handoff="replicated")`` runs it: the sender all-gathers its
    shards packed along the hidden dimension and trims them to ``N`` rows,
    the transport sends a 1/TP slice of each key (the whole key where TP does
    not divide its elements) and all-gathers it on the receiver, which shards
    it again. ``replicated / sp`` per ``N`` is the figure.
``peak``
    What the link and the memory can do: a large peer copy GPU 0 → GPU 1 (the
    link's peak, read by every other table), a large NCCL send and all-gather,
    and a large copy inside GPU 0.

Timing follows nccl-tests: warm up; then, ``--reps`` times, align the ranks
(device synchronise, host barrier), enqueue ``M`` iterations back to back
between two CUDA events and divide by ``M``. ``M`` is chosen from the warm-up
so that one repetition lasts about ``--target-ms``, the same on every rank.
Each repetition's figure is the slowest rank's; a measurement reports their
median, minimum and maximum, and keeps every repetition of every rank. With
``--cuda-graph`` the ``M`` iterations are captured once and each repetition
replays the graph. Bandwidths: ``algbw = bytes / time``; ``busbw`` scales it
by ``(n-1)/n`` for an all-gather of ``n`` ranks and by 1 for a send or a copy.

Every point first checks that each variant delivers exactly the rows the
model needs. Results go to ``--out`` as JSON (setup, device, versions,
command, every repetition) and a Markdown table built from that JSON alone
(``--table-from FILE.json`` rebuilds it); both are rewritten after every
point (``complete`` is false until the last), and a line per point says how
far the run is and about how long is left.

    python -m torch.distributed.run --nproc-per-node 2 eval/nccl_bench.py \\
        --part peak,gather,components
    python -m torch.distributed.run --nproc-per-node 4 eval/nccl_bench.py \\
        --part handoff --tp 2

with ``python`` an interpreter that has PyTorch (``make nccl-bench`` uses
``.venv``'s); the script needs nothing else of this checkout. On CPU it runs
the same code over gloo (host clock instead of CUDA events), which is how the
tests keep it honest without a GPU; there the default grid is small
(``CPU_TOKENS``, ``CPU_PEAK_MIB``), and the first line says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# vLLM's all-gather calls all_gather_into_tensor; newer PyTorch warns about it.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")

__all__ = [
    "RowsDiffer",
    "check_gather",
    "check_handoff",
    "crossover",
    "gather_steps",
    "layout_problem",
    "main",
    "markdown",
    "packed_gather",
    "packed_nocopy_gather",
    "separate_gather",
    "summarize",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PARTS = ("peak", "gather", "components", "handoff")
DEFAULT_TOKENS = "8,64,256,1024,4096,16384,32768"
# On the CPU (gloo): a check of the script and a rough comparison, in minutes.
CPU_TOKENS = "8,64,256,1024"
CPU_PEAK_MIB = 64
# Multicast over NVLink can take a shared host's GPUs down: always off.
SAFETY_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
GatherFn = Callable[[torch.Tensor], torch.Tensor]


class RowsDiffer(AssertionError):
    """A variant delivered other rows than the model needs."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- what the model does at the end gather, and its alternatives ----------


def packed_gather(
    parts: Sequence[torch.Tensor], n: int, gather: GatherFn
) -> list[torch.Tensor]:
    """The model's path: one buffer, one gather, trim to ``n``, split back."""
    hidden = parts[0].shape[-1]
    packed = torch.cat(list(parts), dim=-1)
    return list(gather(packed)[:n].split(hidden, dim=-1))


def packed_nocopy_gather(
    packed: torch.Tensor, n: int, hidden: int, gather: GatherFn
) -> list[torch.Tensor]:
    """Packing without the copy: the states were written into ``packed``."""
    return list(gather(packed)[:n].split(hidden, dim=-1))


def separate_gather(
    parts: Sequence[torch.Tensor], n: int, gather: GatherFn
) -> list[torch.Tensor]:
    """One gather per state, each trimmed to ``n``."""
    return [gather(part)[:n] for part in parts]


def check_rows(label: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]):
    if len(got) != len(want):
        raise RowsDiffer(f"{label}: {len(got)} tensors, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            raise RowsDiffer(
                f"{label}: tensor {i} has shape {tuple(g.shape)}, "
                f"expected {tuple(w.shape)}"
            )
        if not torch.equal(g, w):
            bad = (g != w).any(dim=-1).nonzero().flatten()
            raise RowsDiffer(
                f"{label}: tensor {i} differs in {bad.numel()} rows, "
                f"first {bad[:5].tolist()}"
            )


def full_states(
    n: int, count: int, hidden: int, seed: int, dtype, device
) -> list[torch.Tensor]:
    """``count`` random ``[n, hidden]`` tensors, the same on every rank."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn((n, hidden), generator=generator, device=device).to(dtype)
        for _ in range(count)
    ]


def shard(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows ``[r·c, (r+1)·c)`` of the zero-padded sequence, ``c = ceil(N/TP)``."""
    rows = ceil_div(full.shape[0], tp)
    padded = full.new_zeros((tp * rows, *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()


def gather_steps(
    parts: Sequence[torch.Tensor],
    n: int,
    gather: GatherFn,
    residuals: Sequence[torch.Tensor] | None = None,
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """One end-gather step per variant, each returning the ``N``-row states.

    Without ``residuals`` the states are ``parts`` as they lie (for
    *packed_nocopy*: already in one buffer). With them, every step first makes
    each state as the model's last layer and aux captures do, ``x + r``;
    *packed_nocopy* writes each sum straight into its slice of the buffer.
    """
    hidden = parts[0].shape[-1]
    if residuals is None:
        buffer = torch.cat(list(parts), dim=-1)
        return {
            "packed": lambda: packed_gather(parts, n, gather),
            "separate": lambda: separate_gather(parts, n, gather),
            "packed_nocopy": lambda: packed_nocopy_gather(buffer, n, hidden, gather),
        }
    pairs = list(zip(parts, residuals, strict=True))

    def states() -> list[torch.Tensor]:
        return [torch.add(x, r) for x, r in pairs]

    def written() -> torch.Tensor:
        buffer = parts[0].new_empty((parts[0].shape[0], len(pairs) * hidden))
        for j, (x, r) in enumerate(pairs):
            torch.add(x, r, out=buffer[:, j * hidden : (j + 1) * hidden])
        return buffer

    return {
        "packed": lambda: packed_gather(states(), n, gather),
        "separate": lambda: separate_gather(states(), n, gather),
        "packed_nocopy": lambda: packed_nocopy_gather(written(), n, hidden, gather),
    }


VARIANT_LABELS = {
    "packed": "packed gather",
    "separate": "separate gathers",
    "packed_nocopy": "packed gather without copy",
}


def check_gather(
    n: int,
    k: int,
    hidden: int,
    tp: int,
    rank: int,
    gather: GatherFn,
    *,
    producer: bool = False,
    dtype=torch.float32,
    device: torch.device | str = "cpu",
) -> None:
    """Every variant delivers the ``N`` rows of the final and all ``k`` aux
    states, in order, on this rank; raises :class:`RowsDiffer` otherwise."""
    seed = 7919 * n + k
    full = full_states(n, k + 1, hidden, seed=seed, dtype=dtype, device=device)
    parts = [shard(t, tp, rank) for t in full]
    residuals, want = None, full
    if producer:
        full_r = full_states(n, k + 1, hidden, seed + 1, dtype=dtype, device=device)
        residuals = [shard(t, tp, rank) for t in full_r]
        want = [x + r for x, r in zip(full, full_r, strict=True)]
    for name, step in gather_steps(parts, n, gather, residuals).items():
        check_rows(f"{VARIANT_LABELS[name]} (N={n}, k={k})", step(), want)


# --- statistics, bandwidth, crossover ---------------------------------------


def summarize(per_rank_s: Sequence[Sequence[float]], iters: int) -> dict:
    """Per repetition, the slowest rank; then median and spread over them."""
    slowest = [max(column) * 1e6 for column in zip(*per_rank_s, strict=True)]
    median = statistics.median(slowest)
    return {
        "iters": iters,
        "reps_us": slowest,
        "per_rank_us": [[t * 1e6 for t in row] for row in per_rank_s],
        "median_us": median,
        "min_us": min(slowest),
        "max_us": max(slowest),
        "spread_pct": 100 * (max(slowest) - min(slowest)) / median,
    }


def with_bandwidth(measurement: dict, nbytes: int, bus_factor: float) -> dict:
    seconds = measurement["median_us"] / 1e6
    algbw = nbytes / seconds / 1e9
    return measurement | {
        "bytes": nbytes,
        "bus_factor": bus_factor,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * bus_factor,
    }


def crossover(points: Sequence[dict], k: int) -> dict:
    """Where the packed gather stops being at least as fast as separate ones.

    ``first_slower_N`` is the smallest measured ``N`` from which packing is
    slower at every larger measured ``N``; ``threshold_N`` interpolates the
    crossing of ``packed / separate = 1`` in ``log N`` between it and the
    point before.
    """
    rows = sorted((p for p in points if p["k"] == k), key=lambda p: p["N"])
    result = {"k": k, "first_slower_N": None, "last_not_slower_N": None}
    result |= {"threshold_N": None, "threshold_packed_bytes_per_rank": None}
    result["slower_at_N"] = [p["N"] for p in rows if p["packed_over_separate"] > 1]
    if not rows:
        return result
    first = None
    for i in range(len(rows) - 1, -1, -1):
        if rows[i]["packed_over_separate"] > 1:
            first = i
        else:
            break
    if first is None:
        return result
    result["first_slower_N"] = rows[first]["N"]
    if first == 0:
        return result
    before, after = rows[first - 1], rows[first]
    result["last_not_slower_N"] = before["N"]
    r0, r1 = before["packed_over_separate"], after["packed_over_separate"]
    x0, x1 = math.log(before["N"]), math.log(after["N"])
    n_star = math.exp(x0 + (1 - r0) / (r1 - r0) * (x1 - x0))
    per_row = before["packed_bytes_per_rank"] / before["rows_per_rank"]
    tp = before["tp"]
    result["threshold_N"] = n_star
    result["threshold_packed_bytes_per_rank"] = per_row * n_star / tp
    return result


# --- process groups and the clock -----------------------------------------


@dataclass
class Group:
    ranks: list[int]
    device_pg: object  # the backend that moves tensors (nccl or gloo)
    host_pg: object  # gloo: barriers that leave the GPUs idle

    @property
    def member(self) -> bool:
        return dist.get_rank() in self.ranks


def make_group(ranks: Sequence[int], cuda: bool) -> Group:
    """Every rank must call this, in the same order."""
    ranks = list(ranks)
    device_pg = dist.new_group(ranks)
    host_pg = dist.new_group(ranks, backend="gloo") if cuda else device_pg
    return Group(ranks, device_pg, host_pg)


class Clock:
    """Back-to-back timing of a step on the members of a group."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.graph = bool(args.cuda_graph)

    def align(self, group: Group) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group.host_pg)

    def _block(self, run: Callable[[], object]) -> float:
        """Seconds one call of ``run`` takes on this rank."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        run()
        return time.perf_counter() - begin

    def _exchange(self, values: list[float], group: Group) -> list[list[float]]:
        """Every member's ``values``, in rank order."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = mine.new_empty(len(group.ranks) * len(values))
        dist.all_gather_into_tensor(out, mine, group=group.device_pg)
        return out.reshape(len(group.ranks), len(values)).tolist()

    def measure(self, step: Callable[[], object], group: Group) -> dict:
        args = self.args

        def loop(count: int) -> Callable[[], None]:
            def run() -> None:
                for _ in range(count):
                    step()

            return run

        self.align(group)
        self._block(loop(args.warmup))  # allocations, lazy communicators
        self.align(group)
        estimate = self._block(loop(args.warmup)) / args.warmup
        estimate = max(max(row) for row in self._exchange([estimate], group))
        iters = int(
            min(args.max_iters, max(args.min_iters, args.target_ms / 1e3 / estimate))
        )
        run = loop(iters)
        if self.graph:
            run = self._capture(run)
        figures = []
        for _ in range(args.reps):
            self.align(group)
            figures.append(self._block(run) / iters)
        return summarize(self._exchange(figures, group), iters)

    def _capture(self, run: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # Thread-local: the process group's watchdog thread keeps querying.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            run()
        torch.cuda.synchronize()
        return graph.replay


def all_gather_rows(x: torch.Tensor, pg) -> torch.Tensor:
    """``sp_all_gather``: the ranks' row shards, stacked in rank order."""
    size = dist.get_world_size(pg)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=pg)
    return out


# --- the parts ----------------------------------------------------------------


def gather_point(args, n: int, k: int, group: Group, clock: Clock, device) -> dict:
    tp = len(group.ranks)
    rank = group.ranks.index(dist.get_rank())
    rows, esize = ceil_div(n, tp), torch.empty((), dtype=args.torch_dtype).itemsize

    def gather(x: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(x, group.device_pg)

    dtype, producer = args.torch_dtype, args.producer
    check_gather(
        n,
        k,
        args.hidden,
        tp,
        rank,
        gather,
        producer=producer,
        dtype=dtype,
        device=device,
    )
    count = (k + 1) * (2 if producer else 1)
    states = full_states(n, count, args.hidden, 31 * n + k, dtype, device)
    parts = [shard(t, tp, rank) for t in states]
    del states
    residuals = parts[k + 1 :] if producer else None
    steps = gather_steps(parts[: k + 1], n, gather, residuals)
    gathered = (k + 1) * tp * rows * args.hidden * esize
    factor = (tp - 1) / tp
    point = {"N": n, "k": k, "tp": tp, "rows_per_rank": rows}
    point["packed_bytes_per_rank"] = (k + 1) * rows * args.hidden * esize
    point["gathered_bytes"] = gathered
    for name, step in steps.items():
        point[name] = with_bandwidth(clock.measure(step, group), gathered, factor)
    point["packed_over_separate"] = (
        point["packed"]["median_us"] / point["separate"]["median_us"]
    )
    point["nocopy_over_separate"] = (
        point["packed_nocopy"]["median_us"] / point["separate"]["median_us"]
    )
    point["packed_separate_overlap"] = (
        point["packed"]["min_us"] <= point["separate"]["max_us"]
        and point["separate"]["min_us"] <= point["packed"]["max_us"]
    )
    return point


def send_states(tensors, peer: int, pg) -> None:
    # The PP transport sends one tensor after another.
    for t in tensors:
        dist.send(t, peer, group=pg)


def recv_states(out, peer: int, pg) -> None:
    for t in out:
        dist.recv(t, peer, group=pg)


def components_point(args, n: int, pair: Group, clock: Clock, device) -> dict:
    """Rank 0 → rank 1 send of both shards; all-gather of both shards."""
    rank = pair.ranks.index(dist.get_rank())
    rows, esize = ceil_div(n, 2), torch.empty((), dtype=args.torch_dtype).itemsize
    full = full_states(n, 2, args.hidden, 17 * n, args.torch_dtype, device)
    mine = [shard(t, 2, rank) for t in full]  # hidden_states, residual
    sender_rows = [shard(t, 2, 0) for t in full]
    inbox = [torch.empty_like(t) for t in mine]
    peer = pair.ranks[1 - rank]

    def send() -> None:
        if rank == 0:
            send_states(sender_rows, peer, pair.device_pg)
        else:
            recv_states(inbox, peer, pair.device_pg)

    def all_gather() -> list[torch.Tensor]:
        return [all_gather_rows(t, pair.device_pg)[:n] for t in mine]

    send()
    if rank == 1:
        check_rows(f"send (N={n})", inbox, sender_rows)
    check_rows(f"all-gather (N={n})", all_gather(), full)
    nbytes = 2 * rows * args.hidden * esize
    point = {"N": n, "rows_per_rank": rows, "bytes_per_tensor": nbytes // 2}
    point["send"] = with_bandwidth(clock.measure(send, pair), nbytes, 1.0)
    point["all_gather"] = with_bandwidth(
        clock.measure(all_gather, pair), 2 * nbytes, 0.5
    )
    send_us, gather_us = point["send"]["median_us"], point["all_gather"]["median_us"]
    point["derived_handoff_ratio"] = (send_us + 2 * gather_us) / send_us
    return point


def gather_before_send(
    shards: Sequence[torch.Tensor], n: int, gather: GatherFn
) -> list[torch.Tensor]:
    """The replicated sender: every key's shard in one packed all-gather,
    trimmed to ``n`` rows and split back (MiniMax-M3 in vLLM 0.34.0)."""
    return packed_gather(shards, n, gather)


def transport_slice(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """What vLLM's transport sends of a TP-replicated key: this rank's 1/TP of
    its elements, or the whole key where TP does not divide them."""
    if full.numel() % tp:
        return full
    return full.reshape(tp, -1)[rank]


def reshard_after_recv(
    received: Sequence[torch.Tensor], n: int, tp: int, rank: int, gather: GatherFn
) -> list[torch.Tensor]:
    """The replicated receiver: each key's slices all-gathered back to ``n``
    rows (whole keys as they came), then this rank's shard of them."""
    rows = []
    for part in received:
        full = part if part.dim() == 2 else gather(part.reshape(1, -1))
        rows.append(shard(full.reshape(n, -1), tp, rank))
    return rows


def check_handoff(
    n: int,
    hidden: int,
    tp: int,
    rank: int,
    gather: GatherFn,
    *,
    dtype=torch.float32,
    device: torch.device | str = "cpu",
) -> None:
    """The replicated hand-off's sender and receiver on this TP rank, the
    send between them left out, give back exactly this rank's shards of
    ``hidden_states`` and ``residual``; raises :class:`RowsDiffer` otherwise."""
    full = full_states(n, 2, hidden, seed=13 * n, dtype=dtype, device=device)
    mine = [shard(t, tp, rank) for t in full]
    sent = [transport_slice(t, tp, rank) for t in gather_before_send(mine, n, gather)]
    got = reshard_after_recv(sent, n, tp, rank, gather)
    check_rows(f"replicated hand-off (N={n}, TP={tp})", got, mine)


def handoff_point(args, n: int, world: Group, stages, clock: Clock, device) -> dict:
    """TP×PP2: stage 0 hands ``hidden_states`` and ``residual`` to stage 1."""
    tp, rank = args.tp, dist.get_rank()
    tp_rank, stage = rank % tp, rank // tp
    tp_pg = stages[stage].device_pg
    peer = rank + tp if stage == 0 else rank - tp
    rows = ceil_div(n, tp)
    esize = torch.empty((), dtype=args.torch_dtype).itemsize
    full = full_states(n, 2, args.hidden, 13 * n, args.torch_dtype, device)
    mine = [shard(t, tp, tp_rank) for t in full]
    inbox = [torch.empty_like(t) for t in mine]
    # What the replicated transport delivers per key: a 1/TP slice (1-D), or
    # the whole N-row key where TP does not divide its elements.
    slices = [
        torch.empty_like(transport_slice(t, tp, tp_rank).reshape(-1))
        if t.numel() % tp == 0
        else torch.empty_like(t)
        for t in full
    ]

    def gather(x: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(x, tp_pg)

    def sp() -> list[torch.Tensor]:
        if stage == 0:
            send_states(mine, peer, None)
            return []
        recv_states(inbox, peer, None)
        return inbox

    def replicated() -> list[torch.Tensor]:
        if stage == 0:
            keys = gather_before_send(mine, n, gather)
            send_states([transport_slice(t, tp, tp_rank) for t in keys], peer, None)
            return []
        recv_states(slices, peer, None)
        return reshard_after_recv(slices, n, tp, tp_rank, gather)

    got_sp, got_rep = sp(), replicated()
    if stage == 1:
        check_rows(f"sp hand-off (N={n})", got_sp, mine)
        check_rows(f"replicated hand-off (N={n})", got_rep, mine)
    nbytes = 2 * rows * args.hidden * esize
    point = {"N": n, "tp": tp, "rows_per_rank": rows, "bytes_per_rank": nbytes}
    point["sp"] = with_bandwidth(clock.measure(sp, world), nbytes, 1.0)
    point["replicated"] = with_bandwidth(clock.measure(replicated, world), nbytes, 1.0)
    point["replicated_over_sp"] = (
        point["replicated"]["median_us"] / point["sp"]["median_us"]
    )
    return point


def peak_part(args, pair: Group, clock: Clock, device) -> dict:
    """Large transfers: what the link and the memory can do on this machine."""
    nbytes = args.peak_mib * 2**20
    rank = pair.ranks.index(dist.get_rank())
    result: dict = {}
    generator = torch.Generator(device=device).manual_seed(5)
    payload = torch.randint(
        0, 256, (nbytes,), generator=generator, device=device, dtype=torch.uint8
    )
    inbox = torch.empty_like(payload)

    def send() -> None:
        if rank == 0:
            dist.send(payload, pair.ranks[1], group=pair.device_pg)
        else:
            dist.recv(inbox, pair.ranks[0], group=pair.device_pg)

    send()
    if rank == 1:
        check_rows("peak send", [inbox], [payload])
    result["nccl_send"] = with_bandwidth(clock.measure(send, pair), nbytes, 1.0)
    half = payload[: nbytes // 2]

    def all_gather() -> torch.Tensor:
        return all_gather_rows(half, pair.device_pg)

    result["all_gather"] = with_bandwidth(clock.measure(all_gather, pair), nbytes, 0.5)
    result["peer_copy"] = result["local_copy"] = None
    result["peer_access"] = None
    if clock.cuda and torch.cuda.device_count() >= 2 and rank == 0:
        result |= copies(args, payload)
    clock.align(pair)
    # Rank 0 alone timed the copies; every rank writes the same report.
    shared = [result if rank == 0 else None]
    dist.broadcast_object_list(shared, src=pair.ranks[0], group=pair.host_pg)
    return shared[0]


def copies(args, payload: torch.Tensor) -> dict:
    """Peer copy to the next GPU and a copy inside this one, host-timed
    around ``M`` back-to-back copies with both devices synchronised."""
    nbytes = payload.numel()
    here = payload.device
    there = torch.device("cuda", (here.index + 1) % torch.cuda.device_count())
    result = {"peer_access": torch.cuda.can_device_access_peer(here, there)}
    targets = {
        "peer_copy": (torch.empty_like(payload, device=there), 1),
        "local_copy": (torch.empty_like(payload), 2),  # read + write
    }
    for name, (target, factor) in targets.items():
        target.copy_(payload)
        torch.cuda.synchronize(here)
        torch.cuda.synchronize(there)
        if not torch.equal(target.to(here), payload):
            raise RowsDiffer(f"{name}: the copy differs")
        figures, iters = [], args.peak_copies
        for _ in range(args.reps):
            torch.cuda.synchronize(here)
            torch.cuda.synchronize(there)
            begin = time.perf_counter()
            for _ in range(iters):
                target.copy_(payload)
            torch.cuda.synchronize(here)
            torch.cuda.synchronize(there)
            figures.append((time.perf_counter() - begin) / iters)
        measured = summarize([figures], iters) | {"timing": "host clock"}
        result[name] = with_bandwidth(measured, factor * nbytes, 1.0)
        del target
    result["peer_copy"]["route"] = f"cuda:{here.index} -> cuda:{there.index}"
    return result


def link_peak(peak: dict | None) -> tuple[float | None, str | None]:
    if not peak:
        return None, None
    if peak.get("peer_copy"):
        return peak["peer_copy"]["busbw_GBps"], "peer_copy"
    return peak["nccl_send"]["busbw_GBps"], "nccl_send"


# --- the report -----------------------------------------------------------


def fmt_us(m: dict) -> str:
    return f"{m['median_us']:,.1f} [{m['min_us']:,.1f}–{m['max_us']:,.1f}]"


def fmt_bw(m: dict, peak: float | None) -> str:
    share = f" ({100 * m['busbw_GBps'] / peak:.0f}%)" if peak else ""
    return f"{m['busbw_GBps']:,.1f}{share}"


def fmt_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def markdown(report: dict) -> str:
    """The tables, from the JSON report alone."""
    setup = report["setup"]
    peak, source = report["link_peak_GBps"], report["link_peak_source"]
    head = (
        f"{setup['backend']}, {report['device']['name']} ×{setup['world']}, "
        f"{setup['dtype']}, hidden {setup['hidden']}, timing: {setup['timing']}, "
        f"{setup['reps']} repetitions of ~{setup['target_ms']} ms each"
    )
    lines = [f"# NCCL bench: {head}", ""]
    if not report.get("complete", True):  # reports before schema 2's key: whole
        lines += [
            "**Incomplete**: the run stopped before its last point; the tables "
            "hold the points it finished.",
            "",
        ]
    lines += [
        "Times: median [min–max] over the repetitions, each the slowest rank's "
        "time per iteration of a back-to-back loop. busbw in GB/s"
        + (f", (share of the link peak, {peak:,.1f} GB/s by {source})" if peak else "")
        + ".",
        "",
    ]
    if report.get("peak"):
        p = report["peak"]
        lines += [
            "## Peak",
            "",
            "| transfer | bytes | time µs | GB/s (busbw) |",
            "| --- | ---: | ---: | ---: |",
        ]
        labels = {
            "peer_copy": "peer copy (copy engine), GPU 0 → GPU 1",
            "nccl_send": f"{setup['backend']} send, rank 0 → rank 1",
            "all_gather": f"{setup['backend']} all-gather, 2 ranks",
            "local_copy": "copy inside GPU 0 (bytes read + written)",
        }
        for key, label in labels.items():
            if p.get(key):
                m = p[key]
                lines.append(
                    f"| {label} | {fmt_bytes(m['bytes'])} | {fmt_us(m)} | "
                    f"{m['busbw_GBps']:,.1f} |"
                )
        lines.append("")
    if report.get("gather"):
        g = report["gather"]
        lines += [
            f"## End gather at TP{g['tp']}",
            "",
            "packed = cat + 1 all-gather + trim + split (the model); separate = "
            "k+1 all-gathers; nocopy = packed without the cat. "
            + (
                "Producers timed: every step first makes each state with an "
                "add (x + r); nocopy writes each sum into its slice of one "
                "buffer. "
                if setup.get("producer")
                else "The states exist before the step (nocopy: already in one "
                "buffer). "
            )
            + "Ratios < 1: faster than separate. `~` marks a point whose packed "
            "and separate ranges overlap.",
            "",
            "| N | k | packed/rank | packed µs | separate µs | nocopy µs | "
            "packed / separate | nocopy / separate | separate busbw | "
            "packed busbw |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for pt in g["points"]:
            mark = " ~" if pt["packed_separate_overlap"] else ""
            lines.append(
                f"| {pt['N']} | {pt['k']} | {fmt_bytes(pt['packed_bytes_per_rank'])} "
                f"| {fmt_us(pt['packed'])} | {fmt_us(pt['separate'])} "
                f"| {fmt_us(pt['packed_nocopy'])} "
                f"| {pt['packed_over_separate']:.3f}{mark} "
                f"| {pt['nocopy_over_separate']:.3f} "
                f"| {fmt_bw(pt['separate'], peak)} | {fmt_bw(pt['packed'], peak)} |"
            )
        lines += ["", "Crossover (packed slower than separate from here on):", ""]
        for c in g["crossover"]:
            if c["first_slower_N"] is None and c["slower_at_N"]:
                text = f"packed is slower at N={c['slower_at_N']}, not at the largest N"
            elif c["first_slower_N"] is None:
                text = "packed is never slower over the measured N"
            elif c["threshold_N"] is None:
                text = (
                    f"packed is slower at every measured N (from {c['first_slower_N']})"
                )
            else:
                text = (
                    f"between N={c['last_not_slower_N']} and N={c['first_slower_N']}; "
                    f"interpolated N ≈ {c['threshold_N']:,.0f}, packed buffer ≈ "
                    f"{fmt_bytes(c['threshold_packed_bytes_per_rank'])} per rank"
                )
            lines.append(f"- k={c['k']}: {text}")
        lines.append("")
    if report.get("components"):
        lines += [
            "## Hand-off components at two GPUs",
            "",
            "send = `hidden_states` and `residual` shards (ceil(N/2) rows each), "
            "rank 0 → rank 1; all-gather = both shards over the two ranks. The "
            "last column is **derived** from the two measurements, not measured.",
            "",
            "| N | rows | bytes/tensor | send µs | send busbw | all-gather µs | "
            "all-gather busbw | (send + 2·all-gather) / send, derived |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for pt in report["components"]["points"]:
            lines.append(
                f"| {pt['N']} | {pt['rows_per_rank']} | "
                f"{fmt_bytes(pt['bytes_per_tensor'])} | {fmt_us(pt['send'])} | "
                f"{fmt_bw(pt['send'], peak)} | {fmt_us(pt['all_gather'])} | "
                f"{fmt_bw(pt['all_gather'], peak)} | "
                f"{pt['derived_handoff_ratio']:.2f}× |"
            )
        lines.append("")
    if report.get("handoff"):
        lines += [
            f"## Hand-off at TP{setup['tp']}×PP2 (measured)",
            "",
            "sp = each shard sent to the same TP rank of the next stage (the "
            "series); replicated = vLLM 0.34.0's way applied to Kimi K3: one "
            "packed all-gather on the sender, trimmed to N rows, a 1/TP slice "
            "of each key sent and all-gathered on the receiver, which shards "
            "it again. Both back to back, as the other parts.",
            "",
            "| N | rows/rank | sp µs | replicated µs | replicated / sp |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for pt in report["handoff"]["points"]:
            lines.append(
                f"| {pt['N']} | {pt['rows_per_rank']} | {fmt_us(pt['sp'])} | "
                f"{fmt_us(pt['replicated'])} | {pt['replicated_over_sp']:.2f}× |"
            )
        lines.append("")
    lines += [f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def describe_device(cuda: bool, device: torch.device) -> dict:
    if not cuda:
        return {"name": platform.processor() or platform.machine() or "cpu"}
    info = {
        "name": torch.cuda.get_device_name(device),
        "count": torch.cuda.device_count(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory,
    }
    for key, command in {
        "nvidia_smi": [
            "nvidia-smi",
            "--query-gpu=name,driver_version,clocks.max.sm",
            "--format=csv,noheader",
        ],
        "topology": ["nvidia-smi", "topo", "-m"],
        "nvlink": ["nvidia-smi", "nvlink", "-s"],
    }.items():
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=30)
            text = proc.stdout.strip() or proc.stderr.strip()
            info[key] = re.sub(r"\x1b\[[0-9;]*m", "", text)  # no terminal colours
        except (OSError, subprocess.SubprocessError) as error:
            info[key] = f"unavailable: {error}"
    return info


def launch_command(argv: Sequence[str]) -> str:
    env = " ".join(f"{k}={os.environ.get(k, '')}" for k in SAFETY_ENV)
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    script = "eval/nccl_bench.py"
    return (
        f"{env} python -m torch.distributed.run --nproc-per-node {nproc} {script} "
        + shlex.join(argv)
    ).strip()


def layout_problem(parts: Sequence[str], tp: int, world: int) -> str | None:
    """Why ``parts`` cannot run at ``--tp tp`` on ``world`` ranks, if they can't."""
    if world % tp or world // tp not in (1, 2):
        return f"start TP or 2·TP ranks: --tp {tp}, {world} ranks"
    if "handoff" in parts and world != 2 * tp:
        return f"handoff runs TP{tp}×PP2: start {2 * tp} ranks, not {world}"
    if {"peak", "components"} & set(parts) and world < 2:
        return "peak and components need 2 ranks"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        default="peak,gather,components",
        help=f"comma-separated parts to run, of {', '.join(PARTS)}",
    )
    parser.add_argument("--tp", type=int, default=2, help="TP size (PP is world/TP)")
    parser.add_argument(
        "--hidden", type=int, default=7168, help="hidden size (Kimi K3: 7168)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16", help="element type"
    )
    parser.add_argument(
        "--tokens",
        help=f"N values, comma-separated (default: {DEFAULT_TOKENS} on GPUs, "
        f"{CPU_TOKENS} on the CPU)",
    )
    parser.add_argument("--aux", default="1,3", help="gather: k values (aux states)")
    parser.add_argument(
        "--reps", type=int, default=20, help="R: timed repetitions per measurement"
    )
    parser.add_argument(
        "--target-ms",
        type=float,
        default=20.0,
        help="how long one repetition should last; sets M, the iterations in it",
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed iterations before timing"
    )
    parser.add_argument("--min-iters", type=int, default=5, help="smallest M")
    parser.add_argument("--max-iters", type=int, default=1000, help="largest M")
    parser.add_argument(
        "--peak-mib",
        type=int,
        help=f"peak: bytes per transfer, MiB (default: 1024 on GPUs, "
        f"{CPU_PEAK_MIB} on the CPU)",
    )
    parser.add_argument(
        "--peak-copies",
        type=int,
        default=10,
        help="peak: back-to-back copies per timed repetition",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the M iterations once and time graph replays",
    )
    parser.add_argument(
        "--producer",
        action="store_true",
        help="gather: make each state with an add inside the timed step",
    )
    parser.add_argument("--name", default="", help="output stem")
    parser.add_argument("--source-commit", default="", help="recorded as given")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/nccl"),
        help="directory of the JSON and Markdown results",
    )
    parser.add_argument("--table-from", type=Path, help="rebuild a table; no run")
    parser.add_argument(
        "--link-peak-from", type=Path, help="a report whose peak part to read"
    )
    args = parser.parse_args(argv)
    args.parts = [p for p in args.part.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown and not args.table_from:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    args.parts = [p for p in PARTS if p in args.parts]
    args.torch_dtype = DTYPES[args.dtype]
    args.parser = parser
    return args


def token_grid(tokens: str | None, cuda: bool) -> tuple[list[int], str]:
    """The N values to measure, and what to say about them before starting.

    On the CPU the collectives run over gloo with the host clock: a check of
    the script and a rough comparison, not NCCL's figures; the GPU grid's
    large N would take many minutes and gigabytes there, so the default is
    the small grid."""
    if cuda:
        return [int(t) for t in (tokens or DEFAULT_TOKENS).split(",")], ""
    note = "nccl-bench: no CUDA device: gloo on the CPU, timed by the host clock"
    if tokens:
        return [int(t) for t in tokens.split(",")], note
    return [int(t) for t in CPU_TOKENS.split(",")], (
        f"{note}; the small CPU grid N={CPU_TOKENS} (the GPU grid is "
        f"N={DEFAULT_TOKENS}; --tokens sets it)"
    )


class Progress:
    """A line per finished point on rank 0: elapsed time, points done, and an
    estimate of the time left from the mean time per point so far (larger N
    take longer, so it is low early in a grid)."""

    def __init__(self, total: int, rank: int) -> None:
        self.total, self.done, self.rank = total, 0, rank
        self.started = time.monotonic()

    def point(self, text: str) -> None:
        self.done += 1
        if self.rank != 0:
            return
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        estimate = (
            f"; about {fmt_duration(left)} left at this pace"
            if self.done < self.total
            else ""
        )
        print(
            f"[{elapsed:6.1f}s] {text}: done ({self.done}/{self.total} points"
            f"{estimate})",
            flush=True,
        )


def fmt_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def save(report: dict, path: Path) -> None:
    """Write the JSON and its table, each replaced whole: an interrupted run
    leaves the last finished point's files, never half a file."""
    for target, text in (
        (path, json.dumps(report, indent=1) + "\n"),
        (path.with_suffix(".md"), markdown(report)),
    ):
        partial = target.with_name(f".{target.name}.tmp")
        partial.write_text(text)
        os.replace(partial, target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        report = json.loads(args.table_from.read_text())
        args.table_from.with_suffix(".md").write_text(markdown(report))
        return 0
    os.environ.update(SAFETY_ENV)
    cuda = torch.cuda.is_available()
    if args.cuda_graph and not cuda:
        args.parser.error("--cuda-graph needs CUDA")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = layout_problem(args.parts, args.tp, world)
    if problem:
        args.parser.error(problem)
    pp = world // args.tp
    tokens, note = token_grid(args.tokens, cuda)
    if args.peak_mib is None:
        args.peak_mib = 1024 if cuda else CPU_PEAK_MIB
        if "peak" in args.parts and not cuda:
            note += f"; peak transfers of {CPU_PEAK_MIB} MiB (--peak-mib)"
    aux = [int(k) for k in args.aux.split(",")]

    whole = make_group(range(world), cuda)
    stages = [
        make_group(range(s * args.tp, (s + 1) * args.tp), cuda) for s in range(pp)
    ]
    pair = make_group([0, 1], cuda) if world > 1 else whole
    clock = Clock(args, device)
    per_part = {
        "peak": 1,
        "gather": len(tokens) * len(aux),
        "components": len(tokens),
        "handoff": len(tokens),
    }
    progress = Progress(sum(per_part[p] for p in args.parts), rank)
    stem = args.name or f"{'_'.join(args.parts)}-TP{args.tp}xPP{pp}-{args.dtype}"
    path = args.out / f"{stem}.json"
    report: dict = {"schema": 2, "parts": args.parts, "complete": False}
    if rank == 0:
        report |= describe_run(args, argv, cuda, device, world, pp, tokens, aux)
        args.out.mkdir(parents=True, exist_ok=True)
        if note:
            print(note, flush=True)
        print(
            f"nccl-bench: {progress.total} points; {path} and its .md are "
            "rewritten after each one, so a stopped run keeps what it finished",
            flush=True,
        )

    def finished(text: str) -> None:
        if rank == 0:  # saved before it is said to be done
            save(with_peak(report, args), path)
        progress.point(text)

    if "peak" in args.parts:
        report["peak"] = peak_part(args, pair, clock, device) if pair.member else None
        finished("peak")
    if "gather" in args.parts:
        last = stages[-1]
        report["gather"] = {"tp": args.tp, "points": [], "crossover": []}
        points = report["gather"]["points"]
        for n in tokens:
            for k in aux:
                point = None
                if last.member:
                    point = gather_point(args, n, k, last, clock, device)
                # The last stage measured; every rank keeps the point.
                shared = [point]
                dist.broadcast_object_list(
                    shared, src=last.ranks[0], group=whole.host_pg
                )
                points.append(shared[0])
                report["gather"]["crossover"] = [crossover(points, k) for k in aux]
                finished(f"gather N={n} k={k}")
    if "components" in args.parts:
        report["components"] = {"points": []}
        for n in tokens:
            if pair.member:
                point = components_point(args, n, pair, clock, device)
                report["components"]["points"].append(point)
            finished(f"components N={n}")
    if "handoff" in args.parts:
        report["handoff"] = {"points": []}
        for n in tokens:
            point = handoff_point(args, n, whole, stages, clock, device)
            report["handoff"]["points"].append(point)
            finished(f"handoff N={n}")

    if rank == 0:
        report["complete"] = True
        save(with_peak(report, args), path)
        print(markdown(report), flush=True)
    dist.barrier(group=whole.host_pg)
    dist.destroy_process_group()
    return 0


def describe_run(
    args: argparse.Namespace,
    argv: list[str] | None,
    cuda: bool,
    device: torch.device,
    world: int,
    pp: int,
    tokens: list[int],
    aux: list[int],
) -> dict:
    """What the report records of the run besides its measurements."""
    timing = "cuda-graph replay" if args.cuda_graph else "cuda events"
    return {
        "setup": {
            "world": world,
            "tp": args.tp,
            "pp": pp,
            "dtype": args.dtype,
            "hidden": args.hidden,
            "backend": "nccl" if cuda else "gloo",
            "timing": timing if cuda else "host clock",
            "reps": args.reps,
            "target_ms": args.target_ms,
            "warmup": args.warmup,
            "min_iters": args.min_iters,
            "max_iters": args.max_iters,
            "tokens": tokens,
            "aux": aux,
            "producer": args.producer,
        },
        "device": describe_device(cuda, device),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "python": platform.python_version(),
        },
        "command": launch_command(sys.argv[1:] if argv is None else argv),
        "argv": sys.argv if argv is None else argv,
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("NCCL_", "TORCH_NCCL", "NVSHMEM_", "TORCH_SYMM"))
        },
        "source_commit": args.source_commit or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def with_peak(report: dict, args: argparse.Namespace) -> dict:
    """``report`` with the link peak its tables read: its own peak part's, or
    that of ``--link-peak-from``."""
    peak, source = link_peak(report.get("peak"))
    if args.link_peak_from and not report.get("peak"):
        earlier = json.loads(args.link_peak_from.read_text())
        peak, source = link_peak(earlier.get("peak"))
        source = f"{source} in {args.link_peak_from.name}"
    report["link_peak_GBps"], report["link_peak_source"] = peak, source
    return report


if __name__ == "__main__":
    sys.exit(main())
