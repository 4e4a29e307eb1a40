# SPDX-License-Identifier: Apache-2.0
"""Throughput sweeps per serving arm (prefill, decode, mixed), and their report.

    .venv/bin/python -m eval.bench run --arm mega-sp --base-url http://head:8691 \\
        --model Kimi-K3 --tokenizer /models/Kimi-K3 [--sweep decode] [--points 1024x8]
    .venv/bin/python -m eval.bench report

from this checkout's root (``make bench`` and ``make bench-report`` run
these): ``run`` takes ``vllm`` from beside the interpreter unless ``--vllm``
names one, and ``report`` plots with matplotlib.

Sweeps (``SWEEPS``): ``prefill`` is the upstream pull request's sweep, its
points and flags unchanged (output one token, so total token throughput is
prefill throughput); ``decode`` is input 1024, output 512, where steady-state
decode dominates; ``mixed`` is input 8192 with a 256-token decode tail.
Every point runs 3 x concurrency measured requests (three waves) after
max(4, concurrency) warm-ups, with ``--ignore-eos``.

``run`` runs ``vllm bench serve`` once per point (``bench_command``), saving
its result (``--save-result``) under ``results/bench/<arm>/`` next to a
manifest. Finished points are skipped, so a failed or interrupted sweep
resumes; a point with failed requests stops the sweep and is kept as
``*.failed.json``.

``report`` renders, per sweep, a table per metric in the pull request's
format (one column per arm, MegaMoE+SP's deltas against each baseline), the
request counts, a verdict per point, a JSON summary and PNG plots. Every
metric is one ``vllm bench serve`` saved; a value it did not save is shown
as missing, never as zero. Computed here are only the comparisons: deltas,
leads, and the verdict's spread (``wave_spread``), from the per-request
latencies the client saves.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eval import serve
from eval.openai_server import (
    ServerError,
    add_server_arguments,
    check_server,
    prefix_caching,
)
from eval.provenance import provenance

PROJECT_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = PROJECT_DIR / "results" / "bench"
WAVES = 3  # measured waves per point


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
    "wave spread, per arm and point: (largest - smallest) / mean of the mean "
    "end-to-end latencies of the three measured waves (concurrency requests "
    "each, in the order sent), in percent; the arm ahead on the sweep's "
    "throughput is ahead beyond the spread when its lead over the next arm "
    "exceeds the two arms' wave spreads added"
)
# Report columns beyond one per arm: (header, arm, against).
DELTAS = (
    ("Mega vs FI+EP", "mega-sp", "fi-ep"),
    ("Mega vs no-EP", "mega-sp", "fi-noep"),
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
    point: Point, base_url: str, model: str, tokenizer: str, result_dir: Path
) -> list[str]:
    """``vllm bench serve`` for one point, with the pull request's flags."""
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
        "--seed", "2026",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", point.filename,
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
            "model": args.model,
            "tokenizer": args.tokenizer,
            **serve.served_as(arm.name),
        }
    )
    manifest["runs"].append(
        {
            "sweep": sweep.name,
            "served_vllm_version": version,
            "points": [str(p) for p in points],
            **provenance(args.target),
        }
    )
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def selected(args: argparse.Namespace) -> list[tuple[Sweep, list[Point]]]:
    """The sweeps and points to run, checked before any server is asked."""
    if not args.tokenizer:
        raise BenchError(
            "TOKENIZER= is empty: set it to the served model's directory or "
            "Hugging Face name (vllm bench serve builds the random prompts "
            "with it), e.g. TOKENIZER=/models/Kimi-K3"
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
    in decode steps that run one after another (README: how long it takes)."""
    measured = sum(p.num_prompts for p in points)
    warmups = sum(p.num_warmups for p in points)
    waves = sum(p.waves_in_sequence for p in points)
    steps = sum(p.waves_in_sequence * (p.output_len - 1) for p in points)
    return (
        f"{sweep.name} sweep: {len(points)} points, {measured} measured and "
        f"{warmups} warm-up requests, {waves} waves one after another "
        f"({steps:,} decode steps in sequence)"
    )


def run_point(args: argparse.Namespace, where: str, point: Point, out: Path) -> dict:
    """One ``vllm bench serve``: its saved result, or the sweep stops here."""
    path = out / point.filename
    command = bench_command(point, args.base_url, args.model, args.tokenizer, out)
    proc = subprocess.run([args.vllm, *command[1:]])
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


def run(args: argparse.Namespace) -> int:
    arm = serve.get_arm(args.arm)
    plan = selected(args)
    args.base_url = args.base_url.rstrip("/")
    version = check_server(args.base_url, args.model, arm.name)
    caching = prefix_caching(args.base_url)
    if caching is not False and not args.allow_prefix_caching:
        state = "has prefix caching on" if caching else "does not report"
        raise BenchError(
            f"the server at {args.base_url} {state} (vllm:cache_config_info in "
            "/metrics): repeated points would read cached prefill. Serve with "
            "--no-enable-prefix-caching, as the arms do, or set "
            "ALLOW_PREFIX_CACHING=1 if you know better"
        )
    out = args.results / arm.name
    out.mkdir(parents=True, exist_ok=True)
    total = sum(len(points) for _, points in plan)
    i, where = 0, arm.name
    try:
        for sweep, points in plan:
            print(describe(sweep, points), flush=True)
            write_manifest(out, args, arm, sweep, points, version)
            for point in points:
                i += 1
                output = "" if point.output_len == 1 else f", output {point.output_len}"
                where = (
                    f"[{i}/{total}] {arm.name} input {point.input_len}{output}, "
                    f"concurrency {point.concurrency}"
                )
                if finished(out / point.filename, point):
                    print(f"{where}: done before, skipped", flush=True)
                    continue
                print(f"{where}: running ({point.num_prompts} requests)", flush=True)
                result = run_point(args, where, point, out)
                print(f"{where}: {headline(point, result)}", flush=True)
    except KeyboardInterrupt:
        raise Interrupted(
            f"{where}: interrupted. Finished points are kept: run the same "
            "command again to resume, finished points are skipped"
        ) from None
    return 0


# -- report --------------------------------------------------------------

Found = dict[str, dict[Point, dict]]  # arm -> point -> saved result


def load_results(results: Path) -> Found:
    """Arm -> point -> saved result, for every finished point of any sweep."""
    _, arms = serve.load_arms()
    found: Found = {}
    for name in arms:
        for sweep in SWEEPS.values():
            for point in sweep.points:
                path = results / name / point.filename
                if path.is_file():
                    found.setdefault(name, {})[point] = json.loads(path.read_text())
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


def verdict(sweep: Sweep, point: Point, found: Found) -> dict | None:
    """The arm ahead on the sweep's throughput, its lead over the next arm,
    and whether the lead exceeds the two arms' wave spreads added."""
    _, arms = serve.load_arms()
    measured = sorted(
        (
            (figure, name)
            for name in arms
            if (figure := value(found.get(name, {}).get(point, {}), sweep.throughput))
            is not None
        ),
        reverse=True,
    )
    if not measured:
        return None
    spreads = {
        name: wave_spread(found[name][point], point)
        for name in arms
        if point in found.get(name, {})
    }
    ahead = measured[0][1]
    if len(measured) == 1:
        return {"ahead": ahead, "next": None, "lead_percent": None,
                "spread_percent": spreads, "beyond_spread": None}  # fmt: skip
    nxt = measured[1][1]
    lead = delta(measured[0][0], measured[1][0])
    both = (spreads.get(ahead), spreads.get(nxt))
    beyond = None if None in both or lead is None else lead > sum(both)
    return {
        "ahead": ahead,
        "next": nxt,
        "lead_percent": lead,
        "spread_percent": spreads,
        "beyond_spread": beyond,
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


def render_metric(sweep: Sweep, metric: str, found: Found) -> list[str]:
    _, arms = serve.load_arms()
    title, unit = METRICS[metric]
    suffix = f" {unit}" if unit == "tok/s" else ""
    header = ["Input", "Concurrency"]
    header += [f"{arm.label}{suffix}" for arm in arms.values()]
    header += [name for name, _, _ in DELTAS]
    rows = []
    for point in sweep.points:
        values = {
            name: value(found.get(name, {}).get(point, {}), metric) for name in arms
        }
        cells = [str(point.input_len), str(point.concurrency)]
        cells += [fmt(metric, values[name]) for name in arms]
        for _, arm, against in DELTAS:
            d = delta(values.get(arm), values.get(against))
            cells.append("missing" if d is None else f"{d:+.1f}%")
        rows.append(cells)
    return [f"#### {title}", "", *table(header, rows)]


def render_requests(sweep: Sweep, found: Found) -> list[str]:
    _, arms = serve.load_arms()
    rows = []
    for point in sweep.points:
        cells = [str(point.input_len), str(point.concurrency)]
        for name in arms:
            result = found.get(name, {}).get(point, {})
            done, failed = result.get("completed"), result.get("failed")
            cells.append(
                "missing"
                if done is None or failed is None
                else f"{done} of {point.num_prompts}, {failed} failed"
            )
        rows.append(cells)
    header = ["Input", "Concurrency", *(arm.label for arm in arms.values())]
    return ["#### Requests", "", *table(header, rows)]


def render_verdicts(sweep: Sweep, found: Found) -> list[str]:
    _, arms = serve.load_arms()
    rows = []
    for point in sweep.points:
        v = verdict(sweep, point, found)
        if v is None:
            continue
        spreads = [
            "missing"
            if name not in v["spread_percent"]
            else "unknown"
            if v["spread_percent"][name] is None
            else f"{v['spread_percent'][name]:.1f}%"
            for name in arms
        ]
        if v["next"] is None:
            lead, word = "missing", f"only {arms[v['ahead']].label} measured"
        else:
            lead = f"{v['lead_percent']:+.1f}% over {arms[v['next']].label}"
            word = {
                True: "beyond the spread",
                False: "within the spread",
                None: "spread unknown",
            }[v["beyond_spread"]]
        rows.append(
            [str(point.input_len), str(point.concurrency), arms[v["ahead"]].label,
             lead, word, *spreads]
        )  # fmt: skip
    header = ["Input", "Concurrency", "Ahead", "Lead", "Verdict"]
    header += [f"{arm.label} wave spread" for arm in arms.values()]
    title = METRICS[sweep.throughput][0].lower()
    return [f"#### Verdict on {title}", "", *table(header, rows, text=3)]


def render_sweep(sweep: Sweep, found: Found) -> list[str]:
    output = sweep.points[0].output_len
    lines = [f"### {sweep.name} sweep: output {output} token{'s' * (output > 1)}", ""]
    for metric in sweep.metrics:
        lines += render_metric(sweep, metric, found) + [""]
    lines += render_requests(sweep, found) + [""]
    lines += render_verdicts(sweep, found) + [""]
    missing = [
        f"{name} {point}"
        for name in serve.load_arms()[1]
        for point in sweep.points
        if point not in found.get(name, {})
    ]
    if missing:
        lines += [f"Missing points: {', '.join(missing)}.", ""]
    return lines


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
                            **{m: value(found[arm][point], m) for m in sweep.metrics},
                            "completed": found[arm][point].get("completed"),
                            "failed": found[arm][point].get("failed"),
                            "wave_spread_percent": wave_spread(
                                found[arm][point], point
                            ),
                        }
                        for arm in found
                        if point in found[arm]
                    },
                    "deltas_percent": {
                        name: {
                            m: delta(
                                value(found.get(arm, {}).get(point, {}), m),
                                value(found.get(against, {}).get(point, {}), m),
                            )
                            for m in sweep.metrics
                        }
                        for name, arm, against in DELTAS
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
    """A line per arm over concurrency; a missing value is left out, not 0."""
    for name, arm in arms.items():
        measured = [
            (p.concurrency, figure)
            for p in points
            if (figure := value(found.get(name, {}).get(p, {}), metric)) is not None
        ]
        if measured:
            ax.plot(*zip(*measured, strict=True), marker="o", label=arm.label)
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
        "--tokenizer", required=True, help="the served model's tokenizer (path or name)"
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
    except (BenchError, ServerError, serve.ServeError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
