# SPDX-License-Identifier: Apache-2.0
"""The GPU bundle's entry script: ``python3 run.py [--out DIR] CHECK...``.

Refuses (exit 2) where torch sees no CUDA GPU, before installing anything.
Otherwise unpacks the patched vLLM sources and the wheels under
``/tmp/k3-sppp-gpu``, puts the import stand-ins last on ``sys.meta_path``,
and runs each named check (``tiny-k3``, ``graphs``, ``legacy-graphs``,
``execute-model``, or ``all``) in its own process, printing a header of
versions first. ``legacy-graphs`` needs the legacy model runner, which vLLM
0.34.0 deleted: ``all`` leaves it out where the bundle's vLLM has none, and
says so (``skipped`` in the summary).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tarfile

BUNDLE = os.path.dirname(os.path.abspath(__file__))
SITE = "/tmp/k3-sppp-gpu/site"
CHECKS = ("tiny-k3", "graphs", "legacy-graphs", "execute-model")
# What a check needs of the bundle's vLLM, where it needs more than the rest.
NEEDS = {"legacy-graphs": "vllm/v1/worker/gpu_model_runner.py"}


def refuse_without_gpu() -> None:
    try:
        import torch
    except ImportError:
        sys.exit("run.py: no torch here; this bundle runs on the lent GPU machine")
    if not torch.cuda.is_available():
        print(
            "run.py: refusing: torch sees no CUDA GPU here; this bundle's checks "
            "run only on a GPU machine (the device tool's nvidia-h200)",
            file=sys.stderr,
        )
        sys.exit(2)


def install() -> None:
    os.makedirs(SITE, exist_ok=True)
    with tarfile.open(os.path.join(BUNDLE, "vllm-src.tar.xz")) as tar:
        tar.extractall(SITE, filter="data")
    wheels = sorted(glob.glob(os.path.join(BUNDLE, "wheels", "*.whl")))
    if wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                SITE,
                *wheels,
            ],
            check=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="+", choices=(*CHECKS, "all"))
    parser.add_argument("--out", help="write each check's log and summary.json here")
    args = parser.parse_args(argv)
    refuse_without_gpu()
    install()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([SITE, BUNDLE]), PYTHONUNBUFFERED="1"
    )
    names = CHECKS if "all" in args.checks else args.checks
    summary = {"command": " ".join(["python3", *sys.argv]), "checks": {}}
    if "all" in args.checks:
        missing = {
            name: f"the bundle's vLLM has no {NEEDS[name]}"
            for name in names
            if name in NEEDS and not os.path.exists(os.path.join(SITE, NEEDS[name]))
        }
        for name, why in missing.items():
            print(f"===== {name}: skipped: {why}", flush=True)
        names = [name for name in names if name not in missing]
        summary["skipped"] = missing
    for name in names:
        run = subprocess.run(
            [sys.executable, "-m", "tests.gpu.run_check", name],
            env=env,
            cwd=BUNDLE,
            capture_output=True,
            text=True,
        )
        text = run.stdout + run.stderr
        print(f"===== {name}: exit {run.returncode}\n{text}", flush=True)
        summary["checks"][name] = run.returncode
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.log"), "w") as f:
                f.write(text)
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if any(summary["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
