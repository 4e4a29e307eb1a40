# SPDX-License-Identifier: Apache-2.0
"""Everything one start of an arm is for: GSM8K, then the chosen bench sweeps.

    .venv/bin/python -m eval.evaluate --arm mega-sp \\
        --base-url http://127.0.0.1:8691 --checkpoint /models/Kimi-K3 \\
        [--model Kimi-K3] [--sweeps prefill,decode|all|none] [--limit 200] \\
        [--repeat 2] [--seed N]

from this checkout's root (``make evaluate`` runs it). Its options mean what
they mean in ``eval.gsm8k run`` and ``eval.bench run``, which it hands them
to (``--model`` the served name, ``--tokenizer`` the bench client's, as in
``vllm bench serve``). Kimi K3 takes minutes
to start on two nodes, so each arm is started once and evaluated whole against
that server: ``gsm8k run``, then ``bench run`` for each sweep, in order, each
writing its results and manifest where ``make gsm8k-compare`` and ``make
bench-report`` read them. A finished step is skipped (GSM8K by its manifest,
bench point by point), so the same command resumes a stopped evaluation. One
manifest, ``results/evaluate/<arm>.json``, says how the arm was served, what
this checkout was, and each step's state and results, rewritten after every
step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from eval import bench, gsm8k, serve
from eval.openai_server import (
    OptionError,
    ServerError,
    add_server_arguments,
    check_server,
    resolve_server_arguments,
)
from eval.provenance import provenance

PROJECT_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = PROJECT_DIR / "results"
EXIT_INTERRUPTED = 130


class EvaluateError(Exception):
    """An evaluation that cannot start, with what to set."""


def parse_sweeps(text: str) -> list[str]:
    """``prefill,decode``, ``all`` or ``none`` as the sweeps to run, in order."""
    if text == "all":
        return list(bench.SWEEPS)
    if text == "none":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in bench.SWEEPS]:
        raise EvaluateError(
            f"SWEEP={text} (--sweeps): {', '.join(unknown)} is no sweep; choose "
            f"from {', '.join(bench.SWEEPS)} (comma-separated), all or none"
        )
    return names


def common_options(args: argparse.Namespace) -> list[str]:
    """The options ``gsm8k`` and ``bench`` share: where, against what, as
    resolved here. The name requests carry goes as ``--served-model-name``,
    which takes any name (``--model`` refuses a path)."""
    options = [
        "--arm", args.arm,
        "--base-url", args.base_url,
        "--served-model-name", args.model_name,
        "--served", str(args.served),
    ]  # fmt: skip
    for flag, value in (
        ("--checkpoint", args.checkpoint),
        ("--tokenizer", args.tokenizer),
        ("--seed", args.seed),
        ("--target", args.target),
    ):
        if value not in (None, ""):
            options += [flag, str(value)]
    return options


def steps(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Each step's name and the command line of its tool's ``main``."""
    shared = common_options(args)
    gsm8k_argv = ["--results", str(args.results / "gsm8k"), "run", *shared]
    if args.limit is not None:
        gsm8k_argv += ["--limit", str(args.limit)]
    if args.data:
        gsm8k_argv += ["--data", str(args.data)]
    planned = [("gsm8k", gsm8k_argv)]
    for sweep in args.sweeps:
        bench_argv = [
            "--results", str(args.results / "bench"), "run", *shared,
            "--sweep", sweep, "--repeat", str(args.repeat),
        ]  # fmt: skip
        if args.points:
            bench_argv += ["--points", args.points]
        if args.allow_prefix_caching:
            bench_argv.append("--allow-prefix-caching")
        planned.append((f"bench {sweep}", bench_argv))
    return planned


def gsm8k_done(args: argparse.Namespace) -> bool:
    return (args.results / "gsm8k" / args.arm / "manifest.json").is_file()


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write(path: Path, manifest: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    resolve_server_arguments(args)
    serve.get_arm(args.arm)
    if args.sweeps and not args.tokenizer:
        raise EvaluateError(
            "no tokenizer for the bench sweeps: set CHECKPOINT= to the served "
            "model's directory (TOKENIZER= overrides it), or SWEEP=none for "
            "GSM8K alone"
        )
    if args.points and len(args.sweeps) != 1:
        raise EvaluateError("POINTS picks points of one sweep: set SWEEP= to one")
    planned = steps(args)
    version = check_server(args.base_url, args.model_name, args.arm)
    path = args.results / "evaluate" / f"{args.arm}.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    manifest.update(
        {
            "arm": args.arm,
            "base_url": args.base_url,
            "model": args.model_name,
            "checkpoint": args.checkpoint,
            "tokenizer": args.tokenizer,
            **serve.served_as(args.arm, args.served),
        }
    )
    this_run = {
        "served_vllm_version": version,
        "started": now(),
        "steps": [{"step": name, "state": "pending"} for name, _ in planned],
        **provenance(args.target),
    }
    manifest["runs"].append(this_run)
    write(path, manifest)
    print(
        f"evaluate: arm {args.arm} against {args.base_url}, vLLM {version}: "
        + ", then ".join(name for name, _ in planned)
        + f"; progress in {path}",
        flush=True,
    )
    for record, (name, argv) in zip(this_run["steps"], planned, strict=True):
        if name == "gsm8k" and gsm8k_done(args):
            record.update(state="done before, skipped")
            print("evaluate: gsm8k: done before, skipped", flush=True)
            write(path, manifest)
            continue
        print(f"evaluate: {name}", flush=True)
        main = gsm8k.main if name == "gsm8k" else bench.main
        record["started"] = now()
        try:
            code = main(argv)
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
        record.update(state="finished" if code == 0 else f"exit {code}", ended=now())
        where = "gsm8k" if name == "gsm8k" else "bench"
        record["results"] = str(args.results / where / args.arm)
        write(path, manifest)
        if code != 0:
            print(
                f"evaluate: {name} stopped (exit {code}); the steps after it did "
                "not run. Run the same command again to resume: finished steps "
                "are skipped",
                file=sys.stderr,
            )
            return code
    print(f"evaluate: arm {args.arm} done; stop its server, start the next arm")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR,
        help="root of results/gsm8k, results/bench and results/evaluate "
        "(default: results)",
    )
    add_server_arguments(parser)
    parser.add_argument(
        "--sweeps",
        type=str,
        default="prefill",
        help="bench sweeps after GSM8K, comma-separated (prefill, decode, "
        "mixed), all, or none (default: prefill, the pull request's)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="one integer for both tools, in each one's meaning: lm-eval's "
        "--seed (all four of its seeds) and vllm bench serve's (its random "
        "prompts) (make: SEED=; default: each tool's, "
        f"{gsm8k.SEED} and {bench.SEED})",
    )
    parser.add_argument(
        "--points", help="a subset of the one sweep's points, e.g. 128x1,8192x4"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every bench point N times (default: 1)",
    )
    parser.add_argument(
        "--allow-prefix-caching",
        action="store_true",
        help="bench a server that caches prefixes or does not say",
    )
    parser.add_argument(
        "--limit",
        type=gsm8k.lm_eval_limit,
        help="lm-eval's --limit: only the first LIMIT GSM8K questions, or below "
        "1 that fraction of them (make: LIMIT=)",
    )
    parser.add_argument(
        "--data", type=Path, help="directory with GSM8K's train.jsonl and test.jsonl"
    )
    args = parser.parse_args(argv)
    try:
        args.sweeps = parse_sweeps(args.sweeps)
        return run(args)
    except (EvaluateError, OptionError, ServerError, serve.ServeError) as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
