# SPDX-License-Identifier: Apache-2.0
"""The GSM8K driver: the paired verdict on crafted runs, and one real lm-eval
run per arm against a local OpenAI-compatible server (no network)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import apply
from eval import gsm8k
from tests.eval.fake_openai import gsm8k_answerer, serving
from tests.eval.test_serve import SERVED_ENV

DATA = Path(__file__).parent / "data" / "gsm8k"
TASK = "gsm8k"


def write_run(
    root: Path,
    arm: str,
    correct: list[bool],
    *,
    doc_ids: list[int] | None = None,
    n_shot: int = 5,
    max_gen_toks: int = gsm8k.MAX_GEN_TOKS,
    seed: str = gsm8k.SEED,
    answer_offset: int = 0,
    dataset: str = "question",
    serve_env: dict[str, str] | None = None,
) -> None:
    """A finished run in lm-eval's layout: per question the same answer text
    (changed by ``answer_offset``) and ``correct`` for both filters."""
    directory = root / arm
    (directory / "lm_eval").mkdir(parents=True)
    doc_ids = list(range(len(correct))) if doc_ids is None else doc_ids
    lines = []
    for doc_id, ok in zip(doc_ids, correct, strict=True):
        for name in gsm8k.FILTERS:
            lines.append(
                json.dumps(
                    {
                        "doc_id": doc_id,
                        "resps": [[f"#### {doc_id + answer_offset}"]],
                        "filter": name,
                        "doc_hash": f"{dataset}-{doc_id}",
                        "prompt_hash": f"prompt-{doc_id}-{n_shot}",
                        "exact_match": 1.0 if ok else 0.0,
                    }
                )
            )
    (directory / "lm_eval" / "samples.jsonl").write_text("\n".join(lines) + "\n")
    accuracy = sum(correct) / len(correct)
    results = {
        "results": {
            TASK: {f"exact_match,{name}": accuracy for name in gsm8k.FILTERS}
            | {f"exact_match_stderr,{name}": 0.01 for name in gsm8k.FILTERS}
        },
        "n-shot": {TASK: n_shot},
        "configs": {
            TASK: {
                "generation_kwargs": {"until": ["Question:"], "temperature": 0.0},
                "fewshot_config": {"sampler": "default"},
            }
        },
    }
    (directory / "lm_eval" / "results.json").write_text(json.dumps(results))
    manifest = {
        "arm": arm,
        "settings": {**gsm8k.settings(seed), "max_gen_toks": max_gen_toks},
        "serve_env": SERVED_ENV if serve_env is None else serve_env,
        "lm_eval": {
            "results": "lm_eval/results.json",
            "samples": "lm_eval/samples.jsonl",
        },
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def compare(root: Path, capsys, baseline: str = "fi-ep") -> tuple[int, str, str]:
    code = gsm8k.main(["--results", str(root), "compare", "--baseline", baseline])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def readme_block(after: str) -> list[str]:
    """docs/evaluation.md's indented block that follows the line ending in ``after``."""
    lines = (gsm8k.PROJECT_DIR / "docs" / "evaluation.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(after)) + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("    "):
            break
        if line.strip():
            block.append(line[4:])
    return block


def verdict_row(report: str, arm: str) -> list[str]:
    (row,) = [
        line
        for line in report.splitlines()
        if line.startswith(f"| {arm} |") and "non-inferior" in line
    ]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_identical_arms_pass(tmp_path, capsys):
    answers = [i % 4 != 0 for i in range(200)]
    for arm in ("fi-ep", "mega-sp", "fi-noep"):
        write_run(tmp_path, arm, answers)
    code, report, _ = compare(tmp_path, capsys)
    assert code == 0
    for arm in ("mega-sp", "fi-noep"):
        assert verdict_row(report, arm) == [
            arm,
            "200",
            "0",
            "0",
            "+0.00",
            "+0.00",
            "1",
            "100.0 %",
            "non-inferior",
        ]
    assert "| fi-ep (baseline) | 75.00 | 1.00 | 75.00 | 1.00 | 200 |" in report
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [v["passed"] for v in saved["verdicts"]] == [True, True]


def test_a_clearly_worse_arm_fails(tmp_path, capsys):
    base = [True] * 180 + [False] * 20
    worse = [False] * 20 + [True] * 160 + [False] * 20  # 20 lost, none won
    write_run(tmp_path, "fi-ep", base)
    write_run(tmp_path, "mega-sp", worse, answer_offset=1)
    code, report, _ = compare(tmp_path, capsys)
    assert code == 1
    row = verdict_row(report, "mega-sp")
    assert row[:5] == ["mega-sp", "200", "20", "0", "-10.00"]
    assert row[-2:] == ["0.0 %", "NOT non-inferior"]


def test_a_better_arm_passes(tmp_path, capsys):
    base = [True] * 150 + [False] * 50
    better = [True] * 180 + [False] * 20
    write_run(tmp_path, "fi-ep", base)
    write_run(tmp_path, "mega-sp", better)
    code, report, _ = compare(tmp_path, capsys)
    assert code == 0
    assert verdict_row(report, "mega-sp")[:5] == ["mega-sp", "200", "0", "30", "+15.00"]


def test_bound_and_mcnemar_follow_their_definitions(tmp_path, capsys):
    """n=100, b=3, c=1: difference −2 points; the paired standard error is
    sqrt(b + c − (c − b)²/n)/n; McNemar's exact p is 2·P(X ≤ 1), X~B(4, ½)."""
    base = [True] * 3 + [False] * 1 + [True] * 96
    other = [False] * 3 + [True] * 1 + [True] * 96
    write_run(tmp_path, "fi-ep", base)
    write_run(tmp_path, "mega-sp", other)
    code, report, _ = compare(tmp_path, capsys)
    se = math.sqrt(3 + 1 - (1 - 3) ** 2 / 100) / 100
    lower = -0.02 - 1.6448536269514722 * se
    row = verdict_row(report, "mega-sp")
    assert row[4:7] == ["-2.00", f"{100 * lower:+.2f}", "0.625"]
    assert code == 1  # -5.27 points is below the -2 point margin


def test_mismatched_question_sets_are_refused(tmp_path, capsys):
    write_run(tmp_path, "fi-ep", [True] * 20)
    write_run(tmp_path, "mega-sp", [True] * 20, doc_ids=list(range(5, 25)))
    code, _, err = compare(tmp_path, capsys)
    assert code == 2
    assert "mega-sp vs fi-ep: question sets: 20 vs 20 questions" in err
    assert not (tmp_path / "compare.md").exists()


def test_other_questions_under_the_same_ids_are_refused(tmp_path, capsys):
    write_run(tmp_path, "fi-ep", [True] * 20)
    write_run(tmp_path, "mega-sp", [True] * 20, dataset="other-split")
    code, _, err = compare(tmp_path, capsys)
    assert code == 2
    assert "question sets: different questions at doc_ids [0, 1, 2, 3, 4]" in err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_shot": 8}, "few-shot settings: n-shot 5 vs 8"),
        ({"max_gen_toks": 256}, "generation settings: max_gen_toks 512 vs 256"),
        (
            {"seed": "7,7,7,7"},
            "seeds (lm-eval's --seed): seed 0,1234,1234,1234 vs 7,7,7,7",
        ),
    ],
)
def test_runs_with_different_settings_are_refused(tmp_path, capsys, changes, message):
    write_run(tmp_path, "fi-ep", [True] * 20)
    write_run(tmp_path, "mega-sp", [True] * 20, **changes)
    code, _, err = compare(tmp_path, capsys)
    assert code == 2
    assert message in err


def test_a_run_served_with_another_environment_is_refused(tmp_path, capsys):
    # A run served before the GEMM-RS variable was renamed.
    old = {("VLLM_KIMI_K3_GEMM_RS" if k == "VLLM_ENABLE_GEMM_RS" else k): v
           for k, v in SERVED_ENV.items()}  # fmt: skip
    write_run(tmp_path, "fi-ep", [True] * 20)
    write_run(tmp_path, "mega-sp", [True] * 20, serve_env=old)
    code, _, err = compare(tmp_path, capsys)
    assert code == 2
    assert "mega-sp vs fi-ep: serving environment: VLLM_ENABLE_GEMM_RS 1 vs None" in err
    assert "serving environment: VLLM_KIMI_K3_GEMM_RS None vs 1" in err


def test_compare_without_the_baseline_says_which_run_is_missing(tmp_path, capsys):
    write_run(tmp_path, "mega-sp", [True] * 20)
    code, _, err = compare(tmp_path, capsys)
    assert code == 2
    assert "no finished run of the baseline fi-ep" in err
    assert "make gsm8k ARM=fi-ep" in err


# -- end to end ----------------------------------------------------------


def start_arm(results: Path, arm: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "eval.gsm8k", "--results", str(results), "run",
         "--arm", arm, "--base-url", url, "--served-model-name", "Kimi-K3",
         "--data", str(DATA)],
        cwd=gsm8k.PROJECT_DIR,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_arm(results: Path, arm: str, url: str) -> subprocess.CompletedProcess[str]:
    return finished(start_arm(results, arm, url))


def test_end_to_end_against_a_local_server(tmp_path, capsys):
    right = gsm8k_answerer(DATA / "test.jsonl")
    wrong = gsm8k_answerer(DATA / "test.jsonl", wrong=True)
    with serving("Kimi-K3", right) as url, serving("Kimi-K3", wrong) as wrong_url:
        # At once, as against three clusters: each arm writes its own run.
        arms = {
            "fi-ep": start_arm(tmp_path, "fi-ep", url),
            "fi-noep": start_arm(tmp_path, "fi-noep", url),
            "mega-sp": start_arm(tmp_path, "mega-sp", wrong_url),
        }
        results = {arm: finished(proc) for arm, proc in arms.items()}
    for arm, result in results.items():
        assert result.returncode == 0, f"{arm}: {result.stdout}{result.stderr}"
        assert "Requesting API" in result.stderr  # lm-eval's progress

    manifest = json.loads((tmp_path / "mega-sp" / "manifest.json").read_text())
    assert manifest["patch_set"] == apply.status()  # .venv, applied by make test
    assert manifest["served_vllm_version"] == "0.33.0"
    assert manifest["lm_eval"]["version"] == "0.4.13"
    assert "--kernel-config" in manifest["serve_command"]
    assert manifest["serve_env"] == SERVED_ENV
    assert manifest["patch_set"]["exit_code"] == apply.EXIT_OK
    # The client's own revision, said as the client's.
    assert manifest["series_revision"]["client"] == apply.status()["revision"]
    assert "client" in manifest["series_revision"]["of"]
    assert manifest["data"] == str(DATA.resolve())
    assert "tokenized_requests=False" in " ".join(manifest["lm_eval"]["args"])
    run = gsm8k.load_arm(tmp_path / "fi-ep")
    assert gsm8k.arm_summary(run) == {
        "n": 15,
        "strict-match": 1.0,
        "strict-match stderr": 0.0,
        "flexible-extract": 1.0,
        "flexible-extract stderr": 0.0,
    }

    code, report, _ = compare(tmp_path, capsys)
    assert code == 1, report
    # docs/evaluation.md shows this run's tables as what `make gsm8k-compare` prints.
    tables = [line for line in report.splitlines() if line.startswith("|")]
    assert tables == readme_block("`make gsm8k-compare` prints:")
    assert verdict_row(report, "fi-noep")[1:4] == ["15", "0", "0"]
    assert verdict_row(report, "fi-noep")[-1] == "non-inferior"
    assert verdict_row(report, "mega-sp")[1:4] == ["15", "15", "0"]
    assert verdict_row(report, "mega-sp")[-1] == "NOT non-inferior"


def test_run_without_a_server_names_the_url_and_the_serve_line(tmp_path):
    result = run_arm(tmp_path, "mega-sp", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "no OpenAI-compatible server at http://127.0.0.1:9/v1/models" in (
        result.stderr
    )
    assert "make serve ARM=mega-sp NODE_RANK=0" in result.stderr
    assert not (tmp_path / "mega-sp").exists()


def test_lm_eval_given_an_include_path_indexes_that_path_alone(tmp_path):
    """eval.lm_eval_run: the local task's run indexes the local task alone,
    not lm-eval's 14,000 built-in task files (about 10 CPU-seconds a run),
    and still reads lm-eval's own gsm8k task through it."""
    (tmp_path / f"{gsm8k.LOCAL_TASK}.yaml").write_text(gsm8k.local_task_yaml(DATA))
    probe = (
        "import sys; from eval import lm_eval_run; "
        "assert lm_eval_run.narrow_to_include_path(); "
        "from lm_eval.tasks import TaskManager; "
        "manager = TaskManager(include_path=sys.argv[1]); "
        "print(manager.all_tasks); "
        "print(manager.load([sys.argv[2]])['tasks'][sys.argv[2]].config.num_fewshot)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path), gsm8k.LOCAL_TASK],
        cwd=gsm8k.PROJECT_DIR,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [f"['{gsm8k.LOCAL_TASK}']", "5"]
