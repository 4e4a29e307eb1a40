# SPDX-License-Identifier: Apache-2.0
"""Throughput sweeps per serving arm (prefill, decode, mixed), and their report.

    .venv/bin/python -m eval.bench run --arm mega-sp --base-url http://head:8691 \\
        --model Kimi-K3 --tokenizer /models/Kimi-K3 [--sweep decode] [--points 1024x8]
    .venv/bin/python -m eval.bench report

from this checkout's root (``make bench`` and ``make bench-report`` run
these): ``run`` takes ``vllm`` from beside the interpreter unless ``--vllm``
names one, and ``report`` plots with matplotlib. The options ``run`` shares
with ``vllm bench serve`` (``--base-url``, ``--model``, ``--served-model-name``,
``--tokenizer``, ``--seed``) mean what they mean there, and the client gets
the name requests carry as ``--model`` and the tokenizer as ``--tokenizer``:
the seed's ``--model Kimi-K3 --tokenizer "$MODEL"`` works here unchanged.

Sweeps (``SWEEPS``): ``prefill`` is the upstream pull request's sweep, its
points and flags unchanged (output one token, so total token throughput is
prefill throughput); ``decode`` is input 1024, output 512, where steady-state
decode dominates; ``mixed`` is input 8192 with a 256-token decode tail.
Every point runs 3 x concurrency measured requests (three waves) after
max(4, concurrency) warm-ups, with ``--ignore-eos``.

``run`` runs ``vllm bench serve`` once per point (``bench_command``), saving
its result (``--save-result``) under ``results/bench/<arm>/`` next to a
manifest; ``--repeat N`` runs every point N times, all points once and then
all again, run k >= 2 saved as ``<point>.run<k>.json``. Finished runs are
skipped, so a failed or interrupted sweep resumes; a run with failed
requests stops the sweep and is kept as ``*.failed.json``.

``report`` renders, per sweep, a table per metric in the pull request's
format (one column per arm, MegaMoE+SP's deltas against each baseline), the
request counts, a verdict per point, a JSON summary and PNG plots. Every
metric is one ``vllm bench serve`` saved, averaged over an arm's runs of the
point; a value a run did not save is shown as missing, never as zero.
Computed here are only the means and the comparisons: deltas, leads, and the
verdict's spreads (``wave_spread`` from the per-request latencies the client
saves, ``run_spread`` from its throughput in each run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eval import serve
from eval.openai_server import (
    OptionError,
    ServerError,
    add_server_arguments,
    check_server,
    prefix_caching,
    resolve_server_arguments,
)
from eval.provenance import provenance

PROJECT_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = PROJECT_DIR / "results" / "bench"
# `vllm bench serve` hands itself to vLLM's Rust client (vllm-rs) when
# VLLM_USE_RUST_BENCH=1. That client saves no per-request latencies (the
# verdict's wave spread) and counts its prompts' tokens otherwise, so its
# figures are not the Python client's: every arm is measured by the Python
# client, the one the pull request measured with.
CLIENT_ENV = {"VLLM_USE_RUST_BENCH": "0"}
WAVES = 3  # measured waves per point
SEED = 2026  # the pull request's --seed


@dataclass(frozen=True, order=True)
class Point:
    input_len: int
    concurrency: int
    output_len: int = 1

    def __str__(self) -> str:
        return f"{self.input_len}x{self.concurrency}"

    @property
    def filename(self) -> str:
        out = "" if self.output_len == 1 else f"-out{self.output_len}"
        return f"in{self.input_len}{out}-c{self.concurrency}.json"

    def run_filename(self, run: int) -> str:
        """Run 1 keeps ``filename``, so results saved before repeats existed
        stay the first run; run k >= 2 is ``<stem>.run<k>.json``."""
        return self.filename if run == 1 else f"{self.filename[:-5]}.run{run}.json"

    @property
    def num_prompts(self) -> int:
        return WAVES * self.concurrency

    @property
    def num_warmups(self) -> int:
        return max(4, self.concurrency)  # at least one full wave

    @property
    def waves_in_sequence(self) -> int:
        """Warm-up and measured waves, one after the other: the point's
        duration in units of one request's latency."""
        return -(-self.num_warmups // self.concurrency) + WAVES

    @property
    def percentile_metrics(self) -> str:
        # TPOT and ITL need a second output token; the seed's prefill points
        # (one token) ask for TTFT and E2EL only, as the seed does.
        return "ttft,e2el" if self.output_len == 1 else "ttft,tpot,itl,e2el"


@dataclass(frozen=True)
class Sweep:
    name: str
    points: tuple[Point, ...]
    metrics: tuple[str, ...]  # one table each, in this order
    throughput: str  # the metric of the verdict and the throughput plot


POINTS = tuple(
    [Point(128, c) for c in (1, 8, 32, 64, 128)]
    + [Point(8192, c) for c in (1, 2, 4, 8)]
    + [Point(32768, 1)]
)
DECODE_METRICS = (
    "output_throughput",
    "total_token_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
)
SWEEPS = {
    sweep.name: sweep
    for sweep in (
        Sweep(
            "prefill",
            POINTS,
            ("total_token_throughput", "mean_ttft_ms"),
            "total_token_throughput",
        ),
        Sweep(
            "decode",
            tuple(Point(1024, c, 512) for c in (1, 8, 32, 64, 128)),
            DECODE_METRICS,
            "output_throughput",
        ),
        Sweep(
            "mixed",
            tuple(Point(8192, c, 256) for c in (1, 4, 8)),
            DECODE_METRICS,
            "total_token_throughput",
        ),
    )
}
VERDICT_RULE = (
    "every figure is the mean over an arm's runs of the point; wave spread, "
    "per arm and point: (largest - smallest) / mean of the mean end-to-end "
    "latencies of the three measured waves (concurrency requests each, in the "
    "order sent), in percent, averaged over the runs; run spread: (largest - "
    "smallest) / mean of the sweep's throughput over the runs, in percent, "
    "none with one run; an arm's spread is the larger of the two; the arm "
    "ahead on the sweep's throughput is ahead beyond the spread when its lead "
    "over the next arm exceeds the two arms' spreads added; an arm with one "
    "run has its wave spread alone, its run-to-run variation unmeasured"
)
# Report columns beyond one per arm: (header, arm, against); a column of a
# variant arm (eval/arms.toml) only where that arm is shown.
DELTAS = (
    ("Mega vs FI+EP", "mega-sp", "fi-ep"),
    ("Mega vs no-EP", "mega-sp", "fi-noep"),
    ("Mega vs seed's", "mega-sp", "mega-sp-seed"),
)
# Key in vllm bench serve's saved result -> (table title, unit).
METRICS = {
    "output_throughput": ("Output token throughput", "tok/s"),
    "total_token_throughput": ("Total token throughput", "tok/s"),
    "mean_tpot_ms": ("Mean TPOT", "ms"),
    "median_tpot_ms": ("Median TPOT", "ms"),
    "p99_tpot_ms": ("P99 TPOT", "ms"),
    "mean_itl_ms": ("Mean ITL", "ms"),
    "median_itl_ms": ("Median ITL", "ms"),
    "p99_itl_ms": ("P99 ITL", "ms"),
    "mean_ttft_ms": ("Mean TTFT", "ms"),
    "p99_ttft_ms": ("P99 TTFT", "ms"),
}


class BenchError(Exception):
    """A sweep that cannot go on, with what to do."""


class Interrupted(BenchError):
    """Ctrl-C during a sweep: finished points are kept."""


def parse_points(text: str | None, sweep: Sweep = SWEEPS["prefill"]) -> list[Point]:
    if not text:
        return list(sweep.points)
    by_name = {str(point): point for point in sweep.points}
    chosen = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        try:
            input_len, concurrency = (int(x) for x in item.lower().split("x"))
        except ValueError as error:
            raise BenchError(
                f"POINTS: {item!r} is not INPUTxCONCURRENCY, e.g. 8192x4"
            ) from error
        name = f"{input_len}x{concurrency}"
        if name not in by_name:
            raise BenchError(
                f"POINTS: {item} is not in the sweep ({sweep.name}: "
                f"{', '.join(by_name)})"
            )
        chosen.append(by_name[name])
    return chosen


def bench_command(
    point: Point,
    base_url: str,
    model: str,
    tokenizer: str,
    result_dir: Path,
    run: int = 1,
    seed: int = SEED,
) -> list[str]:
    """``vllm bench serve`` for one run of a point, with the pull request's
    flags: ``model`` is the name requests carry, ``tokenizer`` the
    checkpoint's, as in the seed's ``run_point``."""
    return [
        "vllm", "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", model,
        "--tokenizer", tokenizer,
        "--trust-remote-code",
        "--dataset-name", "random",
        "--random-input-len", str(point.input_len),
        "--random-output-len", str(point.output_len),
        "--random-range-ratio", "0",
        "--num-prompts", str(point.num_prompts),
        "--num-warmups", str(point.num_warmups),
        "--request-rate", "inf",
        "--max-concurrency", str(point.concurrency),
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", point.percentile_metrics,
        "--metric-percentiles", "50,90,95,99",
        "--seed", str(seed),
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", point.run_filename(run),
    ]  # fmt: skip


def finished(path: Path, point: Point) -> bool:
    """A saved result that measured every request of the point."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return result.get("completed") == point.num_prompts and not result.get("failed")


def write_manifest(
    out: Path, args: argparse.Namespace, arm: serve.Arm, sweep: Sweep, points, version
):
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    manifest.update(
        {
            "arm": arm.name,
            "label": arm.label,
            "base_url": args.base_url,
            "model": args.model_name,
            "tokenizer": args.tokenizer,
            "checkpoint": args.checkpoint,
            **serve.served_as(arm.name, args.served),
        }
    )
    manifest["runs"].append(
        {
            "sweep": sweep.name,
            "served_vllm_version": version,
            "prefix_caching": args.prefix_caching,
            "points": [str(p) for p in points],
            "repeat": args.repeat,
            "seed": args.seed,
            "client_env": CLIENT_ENV,
            **provenance(args.target),
        }
    )
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def selected(args: argparse.Namespace) -> list[tuple[Sweep, list[Point]]]:
    """The sweeps and points to run, checked before any server is asked."""
    if args.repeat < 1:
        raise BenchError(
            f"REPEAT={args.repeat} (--repeat): each point runs at least once; "
            "set 1 (the default) or more, e.g. REPEAT=3"
        )
    resolve_server_arguments(args)
    if not args.tokenizer:
        raise BenchError(
            "no tokenizer: set CHECKPOINT= to the served model's directory "
            "(vllm bench serve builds the random prompts with its tokenizer), "
            "e.g. CHECKPOINT=/models/Kimi-K3; TOKENIZER= overrides it "
            "(--checkpoint, --tokenizer)"
        )
    names = list(SWEEPS) if args.sweep == "all" else [args.sweep]
    if args.points and len(names) > 1:
        raise BenchError(
            "POINTS picks points of one sweep: set SWEEP=prefill, decode or mixed"
        )
    return [(SWEEPS[name], parse_points(args.points, SWEEPS[name])) for name in names]


def headline(point: Point, result: dict) -> str:
    """What a finished point prints: its throughput and latencies."""
    tput = fmt("total_token_throughput", value(result, "total_token_throughput"))
    ttft = fmt("mean_ttft_ms", value(result, "mean_ttft_ms"))
    if point.output_len == 1:
        return f"{tput} tok/s, mean TTFT {ttft}"
    out = fmt("output_throughput", value(result, "output_throughput"))
    tpot = fmt("mean_tpot_ms", value(result, "mean_tpot_ms"))
    return f"{out} output tok/s ({tput} total), mean TPOT {tpot}, mean TTFT {ttft}"


def describe(sweep: Sweep, points: list[Point]) -> str:
    """What a sweep asks for, printed as it starts: its length in waves and
    in decode steps that run one after another (docs/evaluation.md: "How long")."""
    measured = sum(p.num_prompts for p in points)
    warmups = sum(p.num_warmups for p in points)
    waves = sum(p.waves_in_sequence for p in points)
    steps = sum(p.waves_in_sequence * (p.output_len - 1) for p in points)
    return (
        f"{sweep.name} sweep: {len(points)} points, {measured} measured and "
        f"{warmups} warm-up requests, {waves} waves one after another "
        f"({steps:,} decode steps in sequence)"
    )


def run_point(
    args: argparse.Namespace, where: str, point: Point, out: Path, run: int
) -> dict:
    """One ``vllm bench serve``: its saved result, or the sweep stops here."""
    path = out / point.run_filename(run)
    command = bench_command(
        point, args.base_url, args.model_name, args.tokenizer, out, run, args.seed
    )
    proc = subprocess.run([args.vllm, *command[1:]], env={**os.environ, **CLIENT_ENV})
    if proc.returncode != 0 or not finished(path, point):
        if path.exists():
            path.rename(path.with_suffix(".failed.json"))
        raise BenchError(
            f"{where}: "
            + (
                f"vllm bench serve exited {proc.returncode}"
                if proc.returncode
                else "not every request succeeded"
            )
            + f"; the sweep stops here (result kept as "
            f"{path.with_suffix('.failed.json').name}). Fix the server and "
            "run again: finished points are skipped"
        )
    return json.loads(path.read_text())


def progress(
    i: int, total: int, arm: str, point: Point, run_no: int, repeat: int
) -> str:
    """The progress line's head, e.g. ``[5/6] fi-ep run 2/2, input 1024,
    output 512, concurrency 8``; the run is named when there is more than
    one."""
    runs = f" run {run_no}/{repeat}," if repeat > 1 else ""
    output = "" if point.output_len == 1 else f", output {point.output_len}"
    return (
        f"[{i}/{total}] {arm}{runs} input {point.input_len}{output}, "
        f"concurrency {point.concurrency}"
    )


def run(args: argparse.Namespace) -> int:
    arm = serve.get_arm(args.arm)
    plan = selected(args)
    version = check_server(args.base_url, args.model_name, arm.name)
    caching, args.prefix_caching = prefix_caching(args.base_url, args.model_name)
    if caching is not False and not args.allow_prefix_caching:
        state = "has prefix caching on" if caching else "does not say if it caches"
        raise BenchError(
            f"the server at {args.base_url} {state}: "
            f"{args.prefix_caching['observed']}. Repeated points would read "
            "cached prefill. Serve with --no-enable-prefix-caching, as the arms "
            "do, or set ALLOW_PREFIX_CACHING=1 if you know better"
        )
    if os.environ.get("VLLM_USE_RUST_BENCH", "0") != "0":
        print(
            "bench: VLLM_USE_RUST_BENCH is set; the sweep measures with vLLM's "
            "Python client all the same (VLLM_USE_RUST_BENCH=0 for each point): "
            "the Rust client saves no per-request latencies and counts prompt "
            "tokens otherwise, so its figures would not compare",
            file=sys.stderr,
            flush=True,
        )
    out = args.results / arm.name
    out.mkdir(parents=True, exist_ok=True)
    repeat = args.repeat
    total = repeat * sum(len(points) for _, points in plan)
    for sweep, points in plan:
        print(describe(sweep, points), flush=True)
        write_manifest(out, args, arm, sweep, points, version)
    if repeat > 1:
        print(
            f"each point {repeat} times, every point once and then again: "
            f"{repeat} x the above",
            flush=True,
        )
    i, where = 0, arm.name
    running: Path | None = None  # the run's result file while it runs
    try:
        # All points once, then all again: a machine that drifts shows as
        # variation between runs instead of hiding inside one point's runs.
        for run_no in range(1, repeat + 1):
            for _, points in plan:
                for point in points:
                    i += 1
                    where = progress(i, total, arm.name, point, run_no, repeat)
                    path = out / point.run_filename(run_no)
                    if finished(path, point):
                        print(f"{where}: done before, skipped", flush=True)
                        continue
                    print(
                        f"{where}: running ({point.num_prompts} requests)", flush=True
                    )
                    running = path
                    result = run_point(args, where, point, out, run_no)
                    running = None
                    print(f"{where}: {headline(point, result)}", flush=True)
    except KeyboardInterrupt:
        # The client shares the terminal's Ctrl-C and may still save what it
        # measured: an interrupted point is never a finished one.
        aside = ""
        if running is not None and running.exists():
            running.rename(running.with_suffix(".interrupted.json"))
            aside = f" (its partial result kept as {running.stem}.interrupted.json)"
        raise Interrupted(
            f"{where}: interrupted{aside}. Finished points are kept: run the "
            "same command again to resume, finished points are skipped"
        ) from None
    return 0


# -- report --------------------------------------------------------------

Found = dict[str, dict[Point, list[dict]]]  # arm -> point -> saved runs


def run_files(directory: Path, point: Point) -> list[Path]:
    """The saved runs of a point, in run order (``Point.run_filename``);
    ``*.failed.json`` and ``*.interrupted.json`` are not runs."""
    stem = point.filename[:-5]
    numbered = re.compile(re.escape(stem) + r"\.run([1-9][0-9]*)\.json")
    later = sorted(
        (int(match[1]), path)
        for path in directory.glob(f"{stem}.run*.json")
        if (match := numbered.fullmatch(path.name)) and int(match[1]) >= 2
    )
    first = directory / point.filename
    return ([first] if first.is_file() else []) + [path for _, path in later]


def load_results(results: Path) -> Found:
    """Arm -> point -> saved runs, for every point of any sweep with one."""
    _, arms = serve.load_arms()
    found: Found = {}
    for name in arms:
        for sweep in SWEEPS.values():
            for point in sweep.points:
                if paths := run_files(results / name, point):
                    found.setdefault(name, {})[point] = [
                        json.loads(path.read_text()) for path in paths
                    ]
    return found


def value(result: dict, metric: str) -> float | None:
    """The client's figure, or None where it measured none. vllm bench serve
    writes 0 for TPOT and ITL when no request produced a second token."""
    figure = result.get(metric)
    if isinstance(figure, bool) or not isinstance(figure, int | float):
        return None
    if not math.isfinite(figure):
        return None
    no_second_token = result.get("total_output_tokens", 0) <= result.get("completed", 0)
    if ("_tpot_" in metric or "_itl_" in metric) and no_second_token:
        return None
    return float(figure)


def wave_spread(result: dict, point: Point) -> float | None:
    """How much the three measured waves of one run differ, in percent.

    The point's 3 x concurrency requests, in the order ``vllm bench serve``
    sent them (the order of its saved ``latencies``), form three waves of
    ``concurrency`` requests; the spread is (largest - smallest) / mean of the
    waves' mean end-to-end latencies. At a fixed concurrency a wave's
    throughput is concurrency x tokens per request / its mean latency, so
    this is also the waves' relative throughput spread. None when the result
    has no per-request latencies for every request.
    """
    latencies = result.get("latencies")
    if not isinstance(latencies, list) or len(latencies) != point.num_prompts:
        return None
    c = point.concurrency
    means = [sum(latencies[w * c : (w + 1) * c]) / c for w in range(WAVES)]
    average = sum(means) / WAVES
    if average <= 0:
        return None
    return 100 * (max(means) - min(means)) / average


def mean_value(runs: list[dict], metric: str) -> float | None:
    """The mean over the runs of the client's figure; None when a run did
    not measure it (a mean over fewer runs would read as a mean over all)."""
    figures = [value(result, metric) for result in runs]
    if not figures or None in figures:
        return None
    return sum(figures) / len(figures)


def mean_wave_spread(runs: list[dict], point: Point) -> float | None:
    """The wave spread averaged over the runs; None when a run has none."""
    spreads = [wave_spread(result, point) for result in runs]
    if not spreads or None in spreads:
        return None
    return sum(spreads) / len(spreads)


def run_spread(runs: list[dict], metric: str) -> float | None:
    """How much the runs of one point differ, in percent: (largest -
    smallest) / mean of their ``metric``. What the wave spread cannot see (a
    server faster after one restart than another, a busier machine) shows
    here. None with one run, or when a run did not measure ``metric``."""
    figures = [value(result, metric) for result in runs]
    if len(figures) < 2 or None in figures:
        return None
    average = sum(figures) / len(figures)
    if average <= 0:
        return None
    return 100 * (max(figures) - min(figures)) / average


def arm_spread(wave: float | None, between_runs: float | None) -> float | None:
    """The spread a lead must clear for one arm: the larger of its wave and
    run spreads, its wave spread alone with one run, unknown without one."""
    if wave is None:
        return None
    return wave if between_runs is None else max(wave, between_runs)


def verdict(sweep: Sweep, point: Point, found: Found) -> dict | None:
    """The arm ahead on the sweep's throughput (mean over its runs), its
    lead over the next arm, and whether the lead exceeds the two arms'
    spreads added (``arm_spread``)."""
    _, arms = serve.load_arms()
    runs = {name: found[name][point] for name in arms if point in found.get(name, {})}
    measured = sorted(
        (
            (figure, name)
            for name, saved in runs.items()
            if (figure := mean_value(saved, sweep.throughput)) is not None
        ),
        reverse=True,
    )
    if not measured:
        return None
    waves = {name: mean_wave_spread(saved, point) for name, saved in runs.items()}
    between = {
        name: run_spread(saved, sweep.throughput) for name, saved in runs.items()
    }
    spreads = {name: arm_spread(waves[name], between[name]) for name in runs}
    ahead = measured[0][1]
    nxt = measured[1][1] if len(measured) > 1 else None
    lead = None if nxt is None else delta(measured[0][0], measured[1][0])
    both = (spreads[ahead], spreads.get(nxt))
    beyond = None if None in both or lead is None else lead > sum(both)
    return {
        "ahead": ahead,
        "next": nxt,
        "lead_percent": lead,
        "runs": {name: len(saved) for name, saved in runs.items()},
        "wave_spread_percent": waves,
        "run_spread_percent": between,
        "spread_percent": spreads,
        "beyond_spread": beyond,
        # Both arms compared ran more than once: the verdict saw their runs.
        "run_to_run_measured": nxt is not None
        and min(len(runs[ahead]), len(runs[nxt])) > 1,
    }


def fmt(metric: str, figure: float | None) -> str:
    if figure is None:
        return "missing"
    if METRICS[metric][1] == "ms":
        return f"{figure:,.1f} ms"
    return f"{figure:,.0f}"


def delta(figure: float | None, against: float | None) -> float | None:
    if figure is None or not against:
        return None
    return 100 * (figure / against - 1)


def table(header: list[str], rows: list[list[str]], text: int = 0) -> list[str]:
    """Markdown, numbers right-aligned; ``text`` columns from the third on are
    words, left-aligned."""
    align = ["---:"] * 2 + ["---"] * text + ["---:"] * (len(header) - 2 - text)
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def shown_arms(sweep: Sweep, found: Found) -> dict[str, serve.Arm]:
    """The arms a sweep's tables show: every arm, missing or not, but a
    variant only where it has a point of the sweep."""
    _, arms = serve.load_arms()
    return {
        name: arm
        for name, arm in arms.items()
        if arm.variant_of is None or any(p in found.get(name, {}) for p in sweep.points)
    }


def shown_deltas(arms: dict[str, serve.Arm]) -> list[tuple[str, str, str]]:
    return [d for d in DELTAS if d[1] in arms and d[2] in arms]


def render_metric(sweep: Sweep, metric: str, found: Found) -> list[str]:
    arms = shown_arms(sweep, found)
    title, unit = METRICS[metric]
    suffix = f" {unit}" if unit == "tok/s" else ""
    header = ["Input", "Concurrency"]
    header += [f"{arm.label}{suffix}" for arm in arms.values()]
    header += [name for name, _, _ in shown_deltas(arms)]
    rows = []
    for point in sweep.points:
        values = {
            name: mean_value(found.get(name, {}).get(point, []), metric)
            for name in arms
        }
        cells = [str(point.input_len), str(point.concurrency)]
        cells += [fmt(metric, values[name]) for name in arms]
        for _, arm, against in shown_deltas(arms):
            d = delta(values.get(arm), values.get(against))
            cells.append("missing" if d is None else f"{d:+.1f}%")
        rows.append(cells)
    return [f"#### {title}", "", *table(header, rows)]


def total(runs: list[dict], key: str) -> int | None:
    """A request count added over the runs; None when a run lacks it."""
    counts = [result.get(key) for result in runs]
    if not counts or not all(isinstance(n, int) for n in counts):
        return None
    return sum(counts)


def render_requests(sweep: Sweep, found: Found) -> list[str]:
    arms = shown_arms(sweep, found)
    rows = []
    for point in sweep.points:
        cells = [str(point.input_len), str(point.concurrency)]
        for name in arms:
            runs = found.get(name, {}).get(point, [])
            done, failed = total(runs, "completed"), total(runs, "failed")
            cells.append(
                "missing"
                if done is None or failed is None
                else f"{done} of {len(runs) * point.num_prompts}, {failed} failed"
            )
        rows.append(cells)
    header = ["Input", "Concurrency", *(arm.label for arm in arms.values())]
    return ["#### Requests", "", *table(header, rows)]


def percent(figure: float | None) -> str:
    return "unknown" if figure is None else f"{figure:.1f}%"


def spread_cell(v: dict, name: str) -> str:
    """One arm's wave and run spreads, e.g. ``3.1% / 8.4%``; ``1 run`` where
    its run-to-run variation is unmeasured."""
    if name not in v["runs"]:
        return "missing"
    between = (
        "1 run" if v["runs"][name] == 1 else percent(v["run_spread_percent"][name])
    )
    return f"{percent(v['wave_spread_percent'][name])} / {between}"


def verdict_words(v: dict, arms: dict) -> str:
    """Beyond or within the spread, saying which arm ran once: its run-to-run
    variation is then unmeasured and its spread the wave spread alone."""
    if v["beyond_spread"] is None:
        return "spread unknown"
    side = "beyond" if v["beyond_spread"] else "within"
    once = [name for name in (v["ahead"], v["next"]) if v["runs"][name] == 1]
    if not once:
        return f"{side} the spread"
    if len(once) == 2:
        return f"{side} the wave spread; 1 run"
    return f"{side} the spread; 1 run of {arms[once[0]].label}"


def render_verdicts(sweep: Sweep, found: Found) -> list[str]:
    arms = shown_arms(sweep, found)
    rows = []
    for point in sweep.points:
        v = verdict(sweep, point, found)
        if v is None:
            continue
        spreads = [spread_cell(v, name) for name in arms]
        if v["next"] is None:
            lead, word = "missing", f"only {arms[v['ahead']].label} measured"
        else:
            lead = f"{v['lead_percent']:+.1f}% over {arms[v['next']].label}"
            word = verdict_words(v, arms)
        rows.append(
            [str(point.input_len), str(point.concurrency), arms[v["ahead"]].label,
             lead, word, *spreads]
        )  # fmt: skip
    header = ["Input", "Concurrency", "Ahead", "Lead", "Verdict"]
    header += [f"{arm.label} spread (wave / run)" for arm in arms.values()]
    title = METRICS[sweep.throughput][0].lower()
    return [f"#### Verdict on {title}", "", *table(header, rows, text=3)]


def render_sweep(sweep: Sweep, found: Found) -> list[str]:
    output = sweep.points[0].output_len
    lines = [f"### {sweep.name} sweep: output {output} token{'s' * (output > 1)}", ""]
    lines += [runs_line(sweep, found), ""]
    for metric in sweep.metrics:
        lines += render_metric(sweep, metric, found) + [""]
    lines += render_requests(sweep, found) + [""]
    lines += render_verdicts(sweep, found) + [""]
    arms = shown_arms(sweep, found)
    missing = [
        f"{name} {point}"
        for name in arms
        for point in sweep.points
        if point not in found.get(name, {})
    ]
    if missing:
        lines += [f"Missing points: {', '.join(missing)}.", ""]
    for arm in arms.values():
        if (note := serve.differences(arm)) is not None:
            lines += [f"{note}.", ""]
    return lines


def runs_line(sweep: Sweep, found: Found) -> str:
    """Under a sweep's heading: figures are means over runs, and how many."""
    _, arms = serve.load_arms()
    counts = {
        arm.label: sorted(
            {len(found[name][p]) for p in sweep.points if p in found[name]}
        )
        for name, arm in arms.items()
        if any(p in found.get(name, {}) for p in sweep.points)
    }
    every = {n for arm_counts in counts.values() for n in arm_counts}
    if len(every) == 1:
        n = every.pop()
        runs = f"{n} run{'s' * (n > 1)} each"
    else:
        runs = "runs: " + ", ".join(
            f"{label} {c[0]}" if len(c) == 1 else f"{label} {c[0]}-{c[-1]}"
            for label, c in counts.items()
        )
    return (
        "Each figure is the mean over an arm's runs of the point "
        f"({runs}; make bench REPEAT=N runs each point N times)."
    )


def ran(sweep: Sweep, found: Found) -> bool:
    return any(point in points for points in found.values() for point in sweep.points)


def summary(found: Found) -> dict:
    points = []
    for sweep in SWEEPS.values():
        if not ran(sweep, found):
            continue
        for point in sweep.points:
            points.append(
                {
                    "sweep": sweep.name,
                    "input_len": point.input_len,
                    "output_len": point.output_len,
                    "concurrency": point.concurrency,
                    **{
                        arm: {
                            **{m: mean_value(runs[point], m) for m in sweep.metrics},
                            "runs": len(runs[point]),
                            "completed": total(runs[point], "completed"),
                            "failed": total(runs[point], "failed"),
                            "wave_spread_percent": mean_wave_spread(runs[point], point),
                            "run_spread_percent": run_spread(
                                runs[point], sweep.throughput
                            ),
                        }
                        for arm, runs in found.items()
                        if point in runs
                    },
                    "deltas_percent": {
                        name: {
                            m: delta(
                                mean_value(found.get(arm, {}).get(point, []), m),
                                mean_value(found.get(against, {}).get(point, []), m),
                            )
                            for m in sweep.metrics
                        }
                        for name, arm, against in shown_deltas(shown_arms(sweep, found))
                    },
                    "verdict": verdict(sweep, point, found),
                }
            )
    return {"verdict_rule": VERDICT_RULE, "points": points}


def plot_prefill(found: Found, out: Path) -> list[Path]:
    """One PNG per metric: a panel per input length, a line per arm."""
    import matplotlib.pyplot as plt

    _, arms = serve.load_arms()
    sweep = SWEEPS["prefill"]
    lengths = sorted({p.input_len for p in sweep.points})
    written = []
    for metric in sweep.metrics:
        title, unit = METRICS[metric]
        figure, axes = plt.subplots(
            1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False
        )
        for ax, length in zip(axes[0], lengths, strict=True):
            points = [p for p in sweep.points if p.input_len == length]
            draw(ax, arms, found, points, metric)
            ax.set_title(f"input {length} tokens")
        axes[0][0].legend()
        figure.suptitle(f"{title}, output 1 token")
        figure.tight_layout()
        path = out / f"{metric}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def plot_sweep(sweep: Sweep, found: Found, out: Path) -> Path:
    """One PNG: the sweep's throughput and mean TPOT, a line per arm."""
    import matplotlib.pyplot as plt

    _, arms = serve.load_arms()
    figure, axes = plt.subplots(1, 2, figsize=(8.4, 3.6), squeeze=False)
    for ax, metric in zip(axes[0], (sweep.throughput, "mean_tpot_ms"), strict=True):
        draw(ax, arms, found, list(sweep.points), metric)
        ax.set_title(METRICS[metric][0])
    axes[0][0].legend()
    point = sweep.points[0]
    figure.suptitle(
        f"{sweep.name} sweep: input {point.input_len}, output {point.output_len} tokens"
    )
    figure.tight_layout()
    path = out / f"{sweep.name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def draw(ax, arms: dict, found: Found, points: list[Point], metric: str) -> None:
    """A line per arm over concurrency through the means over its runs, a bar
    from the smallest to the largest run; a missing value is left out, not 0."""
    for name, arm in arms.items():
        x, y, below, above = [], [], [], []
        for p in points:
            runs = found.get(name, {}).get(p, [])
            if (mean := mean_value(runs, metric)) is None:
                continue
            figures = [value(result, metric) for result in runs]
            x.append(p.concurrency)
            y.append(mean)
            below.append(mean - min(figures))
            above.append(max(figures) - mean)
        if x:
            # No caps: with one run a bar has no length and draws nothing.
            ax.errorbar(x, y, yerr=[below, above], marker="o", label=arm.label)
    ax.set_xscale("log", base=2)
    ticks = [p.concurrency for p in points]
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(f"{METRICS[metric][0]} ({METRICS[metric][1]})")
    ax.grid(alpha=0.3)


def plot(found: Found, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for sweep in SWEEPS.values():
        if ran(sweep, found):
            written += (
                plot_prefill(found, out)
                if sweep.name == "prefill"
                else [plot_sweep(sweep, found, out)]
            )
    return written


def report(args: argparse.Namespace) -> int:
    found = load_results(args.results)
    if not found:
        raise BenchError(
            f"no saved points under {args.results}: run `make bench ARM=... ` first"
        )
    lines = []
    for sweep in SWEEPS.values():
        if ran(sweep, found):
            lines += render_sweep(sweep, found)
    not_run = [name for name, sweep in SWEEPS.items() if not ran(sweep, found)]
    if not_run:
        lines += [f"Sweeps not run: {', '.join(not_run)} (make bench SWEEP=...).", ""]
    text = "\n".join(lines)
    print(text, end="")
    (args.results / "report.md").write_text(text)
    (args.results / "report.json").write_text(
        json.dumps(summary(found), indent=2, allow_nan=False) + "\n"
    )
    for path in plot(found, args.results):
        print(f"plot: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR,
        help="where results are saved and read (default: results/bench)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="a sweep for one arm")
    add_server_arguments(run_parser)
    run_parser.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help="vllm bench serve's --seed, which seeds its random prompts "
        f"(make: SEED=; default {SEED}, the pull request's)",
    )
    run_parser.add_argument(
        "--sweep",
        choices=[*SWEEPS, "all"],
        default="prefill",
        help="which sweep (default: prefill, the pull request's); all: each in turn",
    )
    run_parser.add_argument(
        "--points", help="a subset of one sweep's points, e.g. 128x1,8192x4"
    )
    run_parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every point N times, all points once and then again "
        "(default: 1); the report averages the runs and weighs their spread",
    )
    run_parser.add_argument(
        "--allow-prefix-caching",
        action="store_true",
        help="run against a server that caches prefixes or does not say",
    )
    run_parser.add_argument(
        "--vllm",
        default=str(Path(sys.executable).parent / "vllm"),
        help="the vllm command that runs `bench serve` (default: this venv's)",
    )
    sub.add_parser("report", help="tables, verdicts, JSON summary and plots")
    args = parser.parse_args(argv)
    try:
        return run(args) if args.command == "run" else report(args)
    except Interrupted as error:
        print(f"bench: {error}", file=sys.stderr)
        return 130
    except (BenchError, OptionError, ServerError, serve.ServeError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
