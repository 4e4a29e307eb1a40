# SPDX-License-Identifier: Apache-2.0
"""The upstream pull request's prefill sweep per serving arm, and its report.

    .venv/bin/python -m eval.bench run --arm mega-sp --base-url http://head:8691 \\
        --model Kimi-K3 --tokenizer /models/Kimi-K3 [--points 128x1,8192x4]
    .venv/bin/python -m eval.bench report

from this checkout's root (``make bench`` and ``make bench-report`` run
these): ``run`` takes ``vllm`` from beside the interpreter unless ``--vllm``
names one, and ``report`` plots with matplotlib.

``run`` runs ``vllm bench serve`` once per point with the pull request's
flags (``bench_command``), saving each result as ``in<L>-c<C>.json`` under
``results/bench/<arm>/`` next to a manifest. Finished points are skipped, so
an interrupted sweep resumes; a point with failed requests stops the sweep
and is kept as ``*.failed.json``. Output length is one token, so total token
throughput is prefill throughput.

``report`` renders, from the saved results, the pull request's two tables
(total token throughput, mean TTFT; one column per arm and the MegaMoE+SP
deltas), a JSON summary and PNG plots. A missing point is shown as missing.
"""

from __future__ import annotations

import argparse
import json
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


@dataclass(frozen=True, order=True)
class Point:
    input_len: int
    concurrency: int

    def __str__(self) -> str:
        return f"{self.input_len}x{self.concurrency}"

    @property
    def filename(self) -> str:
        return f"in{self.input_len}-c{self.concurrency}.json"

    @property
    def num_prompts(self) -> int:
        return 3 * self.concurrency  # three measured waves

    @property
    def num_warmups(self) -> int:
        return max(4, self.concurrency)  # at least one full wave


POINTS = tuple(
    [Point(128, c) for c in (1, 8, 32, 64, 128)]
    + [Point(8192, c) for c in (1, 2, 4, 8)]
    + [Point(32768, 1)]
)
# Report columns beyond one per arm: (header, arm, against).
DELTAS = (
    ("Mega vs FI+EP", "mega-sp", "fi-ep"),
    ("Mega vs no-EP", "mega-sp", "fi-noep"),
)
METRICS = {
    "total_token_throughput": ("Total token throughput", "tok/s"),
    "mean_ttft_ms": ("Mean TTFT", "ms"),
}


class BenchError(Exception):
    """A sweep that cannot go on, with what to do."""


def parse_points(text: str | None) -> list[Point]:
    if not text:
        return list(POINTS)
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
        if Point(input_len, concurrency) not in POINTS:
            raise BenchError(
                f"POINTS: {item} is not in the sweep ({', '.join(map(str, POINTS))})"
            )
        chosen.append(Point(input_len, concurrency))
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
        "--random-output-len", "1",
        "--random-range-ratio", "0",
        "--num-prompts", str(point.num_prompts),
        "--num-warmups", str(point.num_warmups),
        "--request-rate", "inf",
        "--max-concurrency", str(point.concurrency),
        "--ignore-eos",
        "--temperature", "0",
        "--percentile-metrics", "ttft,e2el",
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
    out: Path, args: argparse.Namespace, arm: serve.Arm, points, version
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
            "served_vllm_version": version,
            "points": [str(p) for p in points],
            **provenance(args.target),
        }
    )
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    arm = serve.get_arm(args.arm)
    points = parse_points(args.points)
    base_url = args.base_url.rstrip("/")
    version = check_server(base_url, args.model, arm.name)
    caching = prefix_caching(base_url)
    if caching is not False and not args.allow_prefix_caching:
        state = "has prefix caching on" if caching else "does not report"
        raise BenchError(
            f"the server at {base_url} {state} (vllm:cache_config_info in "
            "/metrics): repeated points would read cached prefill. Serve with "
            "--no-enable-prefix-caching, as the arms do, or set "
            "ALLOW_PREFIX_CACHING=1 if you know better"
        )
    out = args.results / arm.name
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, args, arm, points, version)
    for i, point in enumerate(points, start=1):
        where = (
            f"[{i}/{len(points)}] {arm.name} input {point.input_len}, "
            f"concurrency {point.concurrency}"
        )
        path = out / point.filename
        if finished(path, point):
            print(f"{where}: done before, skipped", flush=True)
            continue
        print(f"{where}: running ({point.num_prompts} requests)", flush=True)
        command = bench_command(point, base_url, args.model, args.tokenizer, out)
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
        result = json.loads(path.read_text())
        print(
            f"{where}: {result['total_token_throughput']:,.0f} tok/s, mean TTFT "
            f"{result['mean_ttft_ms']:,.1f} ms",
            flush=True,
        )
    return 0


# -- report --------------------------------------------------------------


def load_results(results: Path) -> dict[str, dict[Point, dict]]:
    """Arm -> point -> saved result, for every finished point."""
    _, arms = serve.load_arms()
    found: dict[str, dict[Point, dict]] = {}
    for name in arms:
        for point in POINTS:
            path = results / name / point.filename
            if path.is_file():
                found.setdefault(name, {})[point] = json.loads(path.read_text())
    return found


def fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "missing"
    if metric == "mean_ttft_ms":
        return f"{value:,.1f} ms"
    return f"{value:,.0f}"


def delta(value: float | None, against: float | None) -> float | None:
    if value is None or against is None:
        return None
    return 100 * (value / against - 1)


def render_table(metric: str, found: dict[str, dict[Point, dict]]) -> list[str]:
    _, arms = serve.load_arms()
    title, unit = METRICS[metric]
    suffix = f" {unit}" if unit == "tok/s" else ""
    header = ["Input", "Concurrency"]
    header += [f"{arm.label}{suffix}" for arm in arms.values()]
    header += [name for name, _, _ in DELTAS]
    lines = [
        f"#### {title}",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(["---:"] * len(header)) + " |",
    ]
    for point in POINTS:
        values = {name: found.get(name, {}).get(point, {}).get(metric) for name in arms}
        cells = [str(point.input_len), str(point.concurrency)]
        cells += [fmt(metric, values[name]) for name in arms]
        for _, arm, against in DELTAS:
            d = delta(values.get(arm), values.get(against))
            cells.append("missing" if d is None else f"{d:+.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(found: dict[str, dict[Point, dict]]) -> dict:
    return {
        "points": [
            {
                "input_len": point.input_len,
                "concurrency": point.concurrency,
                **{
                    arm: {m: found[arm][point].get(m) for m in METRICS}
                    for arm in found
                    if point in found[arm]
                },
                "deltas_percent": {
                    name: {
                        m: delta(
                            found.get(arm, {}).get(point, {}).get(m),
                            found.get(against, {}).get(point, {}).get(m),
                        )
                        for m in METRICS
                    }
                    for name, arm, against in DELTAS
                },
            }
            for point in POINTS
        ]
    }


def plot(found: dict[str, dict[Point, dict]], out: Path) -> list[Path]:
    """One PNG per metric: a panel per input length, a line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, arms = serve.load_arms()
    lengths = sorted({p.input_len for p in POINTS})
    written = []
    for metric, (title, unit) in METRICS.items():
        figure, axes = plt.subplots(
            1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False
        )
        for ax, length in zip(axes[0], lengths, strict=True):
            for name, arm in arms.items():
                points = sorted(p for p in found.get(name, {}) if p.input_len == length)
                if points:
                    ax.plot(
                        [p.concurrency for p in points],
                        [found[name][p][metric] for p in points],
                        marker="o",
                        label=arm.label,
                    )
            ax.set_title(f"input {length} tokens")
            ax.set_xscale("log", base=2)
            ticks = [p.concurrency for p in POINTS if p.input_len == length]
            ax.set_xticks(ticks, labels=[str(t) for t in ticks])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(f"{title} ({unit})")
            ax.grid(alpha=0.3)
        axes[0][0].legend()
        figure.suptitle(f"{title}, output 1 token")
        figure.tight_layout()
        path = out / f"{metric}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def report(args: argparse.Namespace) -> int:
    found = load_results(args.results)
    if not found:
        raise BenchError(
            f"no saved points under {args.results}: run `make bench ARM=... ` first"
        )
    lines = []
    for metric in METRICS:
        lines += render_table(metric, found) + [""]
    missing = [
        f"{name} {point}"
        for name in serve.load_arms()[1]
        for point in POINTS
        if point not in found.get(name, {})
    ]
    if missing:
        lines.append(f"Missing points: {', '.join(missing)}.")
        lines.append("")
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
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="the sweep for one arm")
    add_server_arguments(run_parser)
    run_parser.add_argument("--tokenizer", required=True)
    run_parser.add_argument("--points", help="subset, e.g. 128x1,8192x4")
    run_parser.add_argument("--allow-prefix-caching", action="store_true")
    run_parser.add_argument(
        "--vllm",
        default=str(Path(sys.executable).parent / "vllm"),
        help="the vllm command that runs `bench serve` (default: this venv's)",
    )
    sub.add_parser("report", help="tables, JSON summary and plots")
    args = parser.parse_args(argv)
    try:
        return run(args) if args.command == "run" else report(args)
    except (BenchError, ServerError, serve.ServeError) as error:
        print(f"bench: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
