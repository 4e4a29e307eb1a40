# SPDX-License-Identifier: Apache-2.0
"""GSM8K per serving arm with lm-eval, and a paired verdict across arms.

    .venv/bin/python -m eval.gsm8k run --arm mega-sp --base-url http://head:8691 \\
        [--model Kimi-K3] [--limit 200] [--seed 0,1234,1234,1234] [--data DIR]
    .venv/bin/python -m eval.gsm8k compare [--baseline fi-ep]

from this checkout's root (``make gsm8k`` and ``make gsm8k-compare`` run
these), with the interpreter that has lm-eval and scipy: ``run`` starts
lm-eval with it. ``--model`` is the served model name (lm-eval's
``model_args`` ``model=``, ``vllm bench serve``'s ``--model``), ``--base-url``
the server's root (``vllm bench serve``'s; lm-eval's ``base_url=`` is it with
``/v1/completions``), and ``--limit`` and ``--seed`` are lm-eval's own.

``run`` checks that the server answers ``/v1/models`` with the model, then
runs lm-eval's ``gsm8k`` task (5-shot, greedy) through ``local-completions``
with the text prompts as lm-eval formats them, and saves lm-eval's results
and per-question samples under ``results/gsm8k/<arm>/`` with a manifest.

``compare`` joins every arm's per-question correctness with the baseline's by
``doc_id`` and gives a paired non-inferiority verdict: with ``b`` questions
the baseline answers right and the arm wrong, and ``c`` the other way round,
the accuracy difference is ``(c - b) / n``; the arm passes when the one-sided
95 % lower bound of that difference is above ``-MARGIN``. McNemar's exact
p-value (scipy) is shown as a secondary figure. Exit status 0 only when every
arm passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
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
    resolve_server_arguments,
)
from eval.provenance import provenance

PROJECT_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = PROJECT_DIR / "results" / "gsm8k"

# Fixed for every arm, so that arms differ only in how the server runs.
TASK = "gsm8k"
LOCAL_TASK = "gsm8k_local"  # the same task over local train/test files
NUM_FEWSHOT = 5
SEED = "0,1234,1234,1234"  # lm-eval's default: python, numpy, torch, few-shot
NUM_CONCURRENT = 16
MAX_GEN_TOKS = 512
REQUEST_TIMEOUT_S = 1200
# Primary metric and margin, fixed before any run: an arm is non-inferior
# when its strict-match accuracy is at most 2 points below the baseline's,
# with 95 % one-sided confidence.
PRIMARY_FILTER = "strict-match"
FILTERS = ("strict-match", "flexible-extract")
MARGIN = 0.02
Z_ONE_SIDED_95 = 1.6448536269514722


class GSM8KError(Exception):
    """A run or comparison that cannot proceed, with what to do."""


def lm_eval_seed(text: str) -> str:
    """lm-eval's ``--seed``, its four seeds written out: one integer for all
    four, or three or four comma-separated integers or ``None`` (a missing
    fourth is lm-eval's default's)."""
    seeds = [item.strip() for item in text.split(",")]
    if len(seeds) == 1:
        seeds *= 4
    elif len(seeds) == 3:
        seeds.append(SEED.split(",")[3])
    if len(seeds) != 4 or not all(
        seed.lower() == "none" or re.fullmatch(r"[+-]?\d+", seed) for seed in seeds
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r}: lm-eval's --seed is one integer for all four seeds, or "
            "four comma-separated integers or None (python, numpy, torch, "
            f"few-shot), e.g. {SEED}"
        )
    return ",".join("None" if seed.lower() == "none" else seed for seed in seeds)


def lm_eval_limit(text: str) -> int | float:
    """lm-eval's ``--limit``: a number of questions, or below 1 a fraction
    of them."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if 0 < value < 1:
        return value
    if value >= 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(
        f"{text!r}: lm-eval's --limit is a number of questions (e.g. 200) or a "
        "fraction of them below 1 (e.g. 0.1)"
    )


# -- run -----------------------------------------------------------------


def local_task_yaml(data_dir: Path) -> str:
    """lm-eval's gsm8k task over ``train.jsonl``/``test.jsonl`` in ``data_dir``
    (for clusters without Hugging Face Hub access)."""
    import lm_eval

    missing = [n for n in ("train.jsonl", "test.jsonl") if not (data_dir / n).is_file()]
    if missing:
        raise GSM8KError(
            f"GSM8K_DATA={data_dir} lacks {missing}: it needs the GSM8K "
            "train and test splits as JSON lines with question and answer"
        )
    upstream = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    return "\n".join(
        [
            f"include: {upstream}",
            f"task: {LOCAL_TASK}",
            "tag: []",
            "dataset_path: json",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            f"    train: {(data_dir / 'train.jsonl').resolve()}",
            f"    test: {(data_dir / 'test.jsonl').resolve()}",
            "",
        ]
    )


def lm_eval_args(
    base_url: str,
    model: str,
    out: Path,
    limit: int | float | None,
    include: Path | None,
    seed: str = SEED,
) -> list[str]:
    """lm-eval's command line: ``model`` is the served name, ``base_url``
    the server's root."""
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={base_url}/v1/completions",
            # Text prompts, no client tokenizer: nothing is truncated to
            # lm-eval's default max_length, and no tokenizer is downloaded.
            "tokenizer_backend=none",
            "tokenized_requests=False",
            f"num_concurrent={NUM_CONCURRENT}",
            "max_retries=3",
            f"timeout={REQUEST_TIMEOUT_S}",
            f"max_gen_toks={MAX_GEN_TOKS}",
        ]
    )
    args = [
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", LOCAL_TASK if include else TASK,
        "--num_fewshot", str(NUM_FEWSHOT),
        "--batch_size", "1",
        "--seed", seed,
        "--log_samples",
        "--output_path", str(out),
    ]  # fmt: skip
    if include is not None:
        args += ["--include_path", str(include)]
    if limit is not None:
        args += ["--limit", str(limit)]
    return args


def run(args: argparse.Namespace) -> int:
    resolve_server_arguments(args)
    arm = serve.get_arm(args.arm)
    base_url = args.base_url
    out = args.results / arm.name
    if (out / "manifest.json").exists():
        if not args.force:
            raise GSM8KError(
                f"{out} holds a finished run; move it away or set FORCE=1 "
                "(it is then kept as <arm>.prev)"
            )
        shutil.rmtree(out.with_name(f"{arm.name}.prev"), ignore_errors=True)
        out.rename(out.with_name(f"{arm.name}.prev"))
    model = args.model_name
    served_version = check_server(base_url, model, arm.name)
    out.mkdir(parents=True, exist_ok=True)
    include = None
    if args.data:
        include = out / "task"
        include.mkdir(exist_ok=True)
        (include / f"{LOCAL_TASK}.yaml").write_text(local_task_yaml(args.data))
    lm_args = lm_eval_args(
        base_url, model, out / "lm_eval", args.limit, include, args.seed
    )
    # lm-eval's command line; with --data it indexes the local task alone
    # (eval/lm_eval_run.py), not lm-eval's 14,000 built-in task files as well.
    command = [sys.executable, "-m", "eval.lm_eval_run", *lm_args]
    print(
        f"gsm8k: arm {arm.name} ({arm.label}) against {base_url}, model "
        f"{model}, vLLM {served_version}; lm-eval's progress follows",
        flush=True,
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "0"}
    # eval.lm_eval_run is found from wherever this runs.
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(PROJECT_DIR), os.environ.get("PYTHONPATH")))
    )
    proc = subprocess.run(command, env=env)
    if proc.returncode != 0:
        raise GSM8KError(f"lm-eval exited {proc.returncode}; see its output above")
    results_file, samples_file = lm_eval_outputs(out / "lm_eval")
    manifest = {
        "arm": arm.name,
        "label": arm.label,
        "base_url": base_url,
        "model": model,
        "checkpoint": args.checkpoint,
        "served_vllm_version": served_version,
        **serve.served_as(arm.name, args.served),
        "lm_eval": {
            "version": lm_eval_version(),
            "args": lm_args,
            "results": str(results_file.relative_to(out)),
            "samples": str(samples_file.relative_to(out)),
        },
        "settings": settings(args.seed),
        "data": str(args.data.resolve()) if args.data else "hub: openai/gsm8k",
        **provenance(args.target),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    summary = arm_summary(load_arm(out))
    print(
        f"gsm8k: {arm.name}: strict-match {summary['strict-match']:.4f}, "
        f"flexible-extract {summary['flexible-extract']:.4f}, n={summary['n']}; "
        f"saved in {out}"
    )
    return 0


def settings(seed: str = SEED) -> dict:
    return {
        "num_fewshot": NUM_FEWSHOT,
        "seed": seed,
        "num_concurrent": NUM_CONCURRENT,
        "max_gen_toks": MAX_GEN_TOKS,
    }


def lm_eval_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lm_eval")


def lm_eval_outputs(root: Path) -> tuple[Path, Path]:
    """lm-eval's newest results file and its samples file under ``root``."""
    results = sorted(root.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        raise GSM8KError(f"{root}: lm-eval wrote no results_*.json")
    stamp = results[-1].stem.removeprefix("results_")
    samples = sorted(results[-1].parent.glob(f"samples_*_{stamp}.jsonl"))
    if len(samples) != 1:
        raise GSM8KError(f"{results[-1].parent}: expected one samples file for {stamp}")
    return results[-1], samples[0]


# -- compare -------------------------------------------------------------


@dataclass
class ArmRun:
    name: str
    manifest: dict
    results: dict  # lm-eval's results file
    task: str
    samples: dict[int, dict]  # doc_id -> sample of the first filter seen
    correct: dict[str, dict[int, bool]]  # filter -> doc_id -> correct


def load_arm(directory: Path) -> ArmRun:
    manifest = json.loads((directory / "manifest.json").read_text())
    results = json.loads((directory / manifest["lm_eval"]["results"]).read_text())
    (task,) = results["results"]
    samples: dict[int, dict] = {}
    correct: dict[str, dict[int, bool]] = {name: {} for name in FILTERS}
    for line in (directory / manifest["lm_eval"]["samples"]).read_text().splitlines():
        sample = json.loads(line)
        samples.setdefault(sample["doc_id"], sample)
        if sample["filter"] in correct:
            correct[sample["filter"]][sample["doc_id"]] = sample["exact_match"] == 1.0
    return ArmRun(directory.name, manifest, results, task, samples, correct)


def arm_summary(run: ArmRun) -> dict:
    row = run.results["results"][run.task]
    summary: dict = {"n": len(run.samples)}
    for name in FILTERS:
        summary[name] = row[f"exact_match,{name}"]
        summary[f"{name} stderr"] = row.get(f"exact_match_stderr,{name}")
    return summary


def differing(base: ArmRun, other: ArmRun, field: str) -> list[int]:
    """The first doc_ids whose samples differ in ``field`` (a hash)."""
    return [
        d for d in sorted(base.samples)
        if base.samples[d][field] != other.samples[d][field]
    ][:5]  # fmt: skip


def comparable(base: ArmRun, other: ArmRun) -> list[str]:
    """Why two runs cannot be compared, each reason naming what differs."""
    reasons = []
    if base.task != other.task:
        reasons.append(f"task: {base.task} vs {other.task}")
    if set(base.samples) != set(other.samples):
        only = sorted(set(base.samples) ^ set(other.samples))
        reasons.append(
            f"question sets: {len(base.samples)} vs {len(other.samples)} "
            f"questions, doc_ids {only[:5]}{'...' if len(only) > 5 else ''} "
            "in one only"
        )
    elif changed := differing(base, other, "doc_hash"):
        reasons.append(f"question sets: different questions at doc_ids {changed}")
    elif prompts := differing(base, other, "prompt_hash"):
        reasons.append(f"few-shot settings: different prompts at doc_ids {prompts}")
    base_shots = base.results.get("n-shot", {}).get(base.task)
    other_shots = other.results.get("n-shot", {}).get(other.task)
    if base_shots != other_shots:
        reasons.append(f"few-shot settings: n-shot {base_shots} vs {other_shots}")
    for key, label in (
        ("generation_kwargs", "generation settings"),
        ("fewshot_config", "few-shot settings"),
    ):
        a = base.results["configs"][base.task].get(key)
        b = other.results["configs"][other.task].get(key)
        if a != b:
            reasons.append(f"{label}: {key} {a} vs {b}")
    # The arms share one environment but for what the arms file makes them
    # differ in (a variant's renamed variable): another difference is a run
    # served from another arms file, or started with other values.
    a = base.manifest.get("serve_env") or {}
    b = other.manifest.get("serve_env") or {}
    declared = {name for name, _ in arm_env(base) ^ arm_env(other)}
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name) and name not in declared:
            reason = f"{name} {a.get(name)} vs {b.get(name)}"
            reasons.append(f"serving environment: {reason}")
    a, b = base.manifest["settings"], other.manifest["settings"]
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            label = "few-shot settings" if "fewshot" in key else "generation settings"
            label = "seeds (lm-eval's --seed)" if key == "seed" else label
            reasons.append(f"{label}: {key} {a.get(key)} vs {b.get(key)}")
    return reasons


def arm_env(run: ArmRun) -> set[tuple[str, str]]:
    """The environment the arms file gives the run's arm; none for an arm it
    no longer has."""
    try:
        return set(serve.declared(run.manifest.get("arm", run.name)).env)
    except serve.ServeError:
        return set()


@dataclass
class Verdict:
    arm: str
    n: int
    b: int  # baseline right, arm wrong
    c: int  # baseline wrong, arm right
    difference: float
    lower_bound: float
    mcnemar_p: float
    identical: float  # share of identical responses

    @property
    def passed(self) -> bool:
        return self.lower_bound > -MARGIN


def paired_verdict(base: ArmRun, other: ArmRun) -> Verdict:
    from scipy.stats import binomtest

    base_ok = base.correct[PRIMARY_FILTER]
    other_ok = other.correct[PRIMARY_FILTER]
    docs = sorted(base_ok)
    n = len(docs)
    b = sum(base_ok[d] and not other_ok[d] for d in docs)
    c = sum(other_ok[d] and not base_ok[d] for d in docs)
    difference = (c - b) / n
    # Variance of the mean of paired differences (each in {-1, 0, 1}).
    spread = math.sqrt(max(b + c - (c - b) ** 2 / n, 0.0)) / n
    mcnemar = binomtest(b, b + c, 0.5).pvalue if b + c else 1.0
    identical = (
        sum(base.samples[d]["resps"] == other.samples[d]["resps"] for d in docs) / n
    )
    return Verdict(
        other.name,
        n,
        b,
        c,
        difference,
        difference - Z_ONE_SIDED_95 * spread,
        mcnemar,
        identical,
    )


def render(runs: list[ArmRun], baseline: str, verdicts: list[Verdict]) -> str:
    def pct(value: object) -> str:
        # lm-eval reports "N/A" for a stderr it cannot compute.
        return f"{100 * value:.2f}" if isinstance(value, int | float) else "–"

    lines = [
        "| arm | strict-match % | ± stderr | flexible-extract % | ± stderr | n |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        s = arm_summary(run)
        name = f"{run.name} (baseline)" if run.name == baseline else run.name
        lines.append(
            f"| {name} | {pct(s['strict-match'])} | {pct(s['strict-match stderr'])} "
            f"| {pct(s['flexible-extract'])} | {pct(s['flexible-extract stderr'])} "
            f"| {s['n']} |"
        )
    lines += [
        "",
        f"Paired against {baseline} on {PRIMARY_FILTER}, joined by doc_id: b = "
        "right in the baseline only, c = right in the arm only. Non-inferior "
        f"when the one-sided 95 % lower bound of (c − b)/n exceeds "
        f"−{100 * MARGIN:g} points.",
        "",
        "| arm | n | b | c | difference (pts) | lower bound (pts) | McNemar p "
        "| identical responses | verdict |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for v in verdicts:
        lines.append(
            f"| {v.arm} | {v.n} | {v.b} | {v.c} | {100 * v.difference:+.2f} | "
            f"{100 * v.lower_bound:+.2f} | {v.mcnemar_p:.3g} | "
            f"{100 * v.identical:.1f} % | "
            f"{'non-inferior' if v.passed else 'NOT non-inferior'} |"
        )
    notes = [
        note
        for run in runs
        if (note := variant_note(run.manifest.get("arm", run.name))) is not None
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def variant_note(arm_name: str) -> str | None:
    """How a variant arm differs from the arm it is a variant of."""
    try:
        return serve.differences(serve.get_arm(arm_name))
    except serve.ServeError:
        return None


def compare(args: argparse.Namespace) -> int:
    directories = (
        sorted(d for d in args.results.iterdir() if (d / "manifest.json").is_file())
        if args.results.is_dir()
        else []
    )
    runs = {d.name: load_arm(d) for d in directories}
    if args.baseline not in runs:
        raise GSM8KError(
            f"no finished run of the baseline {args.baseline} in {args.results} "
            f"(found {sorted(runs)}): run `make gsm8k ARM={args.baseline} ...`"
        )
    if len(runs) < 2:
        raise GSM8KError(f"{args.results}: only {sorted(runs)}; nothing to compare")
    base = runs[args.baseline]
    others = [run for name, run in runs.items() if name != args.baseline]
    refusals = [
        f"{run.name} vs {base.name}: {reason}"
        for run in others
        for reason in comparable(base, run)
    ]
    if refusals:
        raise GSM8KError("runs are not comparable:\n  " + "\n  ".join(refusals))
    verdicts = [paired_verdict(base, run) for run in others]
    report = render([base, *others], base.name, verdicts)
    print(report, end="")
    (args.results / "compare.md").write_text(report)
    (args.results / "compare.json").write_text(
        json.dumps(
            {
                "baseline": base.name,
                "primary_filter": PRIMARY_FILTER,
                "margin": MARGIN,
                "arms": {run.name: arm_summary(run) for run in [base, *others]},
                "verdicts": [{**vars(v), "passed": v.passed} for v in verdicts],
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if all(v.passed for v in verdicts) else 1


EXIT_CODES = """exit status:
  run      0 saved; 1 the run could not start or finish (the message says
           why); 2 a usage error
  compare  0 every arm non-inferior to the baseline; 1 an arm is not;
           2 nothing to compare (no baseline run, one run, or runs that
           differ in questions, few-shot or generation settings, or serving
           environment)"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR,
        help="directory of the runs, one per arm (default: results/gsm8k)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser(
        "run",
        help="GSM8K for one arm",
        description="GSM8K for one arm against its running server.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_arguments(run_parser)
    run_parser.add_argument(
        "--limit",
        type=lm_eval_limit,
        help="lm-eval's --limit: only the first LIMIT questions, or below 1 that "
        "fraction of them (make: LIMIT=; default: all)",
    )
    run_parser.add_argument(
        "--seed",
        type=lm_eval_seed,
        default=SEED,
        help="lm-eval's --seed: python, numpy, torch and few-shot seeds, or one "
        f"for all four (make: SEED=; default {SEED}, lm-eval's); arms run "
        "with other seeds are not compared",
    )
    run_parser.add_argument(
        "--data",
        type=Path,
        help="directory with GSM8K's train.jsonl and test.jsonl, instead of "
        "the Hugging Face Hub",
    )
    run_parser.add_argument(
        "--force",
        action="store_true",
        help="replace a finished run of the arm (kept as <arm>.prev)",
    )
    compare_parser = sub.add_parser(
        "compare",
        help="paired verdict across arms",
        description="Accuracy table and paired non-inferiority verdict per arm.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare_parser.add_argument(
        "--baseline", default="fi-ep", help="the arm others are compared with"
    )
    args = parser.parse_args(argv)
    try:
        return run(args) if args.command == "run" else compare(args)
    except (GSM8KError, OptionError, ServerError, serve.ServeError) as error:
        print(f"gsm8k: {error}", file=sys.stderr)
        return 2 if args.command == "compare" else 1


if __name__ == "__main__":
    sys.exit(main())
