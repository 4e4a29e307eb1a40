# SPDX-License-Identifier: Apache-2.0
"""Build the GPU bundle: what the lent GPU machine needs to run the series.

    .venv/bin/python -m eval.gpu_bundle [--out build/gpu-bundle] [--no-wheels]

(``make gpu-bundle``.) The device has its own torch and Triton, no network
and takes 64 MiB per call, so the bundle (at most ``MAX_BYTES``) holds: the
patched vLLM's Python tree from ``.venv`` (``*.py``, ``*.json``, ``*.jinja``,
its dist-info and the apply journal with its backups, no compiled libraries)
as ``vllm-src.tar.xz``; wheels
for Python 3.12 of the small packages its import chain needs that the device
lacks (:data:`WHEELS`, at the versions ``.venv`` has, fetched once into
``build/gpu-wheels``); the test bed and the GPU checks (``tests/``); and the
entry script ``run.py``, which refuses without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
MAX_BYTES = 60 * 1024 * 1024
WHEELS = (
    "annotated-types",
    "blake3",
    "cachetools",
    "cbor2",
    "msgspec",
    "partial-json-parser",
    "pybase64",
    "pydantic",
    "pydantic-core",
    "pyzmq",
    "setproctitle",
    "typing-inspection",
)
SOURCE_SUFFIXES = (".py", ".json", ".jinja")
TESTS = ("tests/__init__.py", "tests/sppp_testbed", "tests/gpu")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def vllm_source_tar(site_packages: Path) -> bytes:
    """The patched vLLM tree's sources and dist-info, xz-compressed."""
    buffer = io.BytesIO()
    # preset 1: 8.8 MiB in 7 s on 2 busy cores; the default took minutes
    # there for 7 MiB, and `make test` builds the bundle.
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=1) as tar:
        for path in sorted((site_packages / "vllm").rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                tar.add(path, str(path.relative_to(site_packages)))
        for dist_info in site_packages.glob("vllm-*.dist-info"):
            tar.add(dist_info, dist_info.name)
        # The apply journal and its backups of the originals: the series'
        # revision for the stage announcement, and vLLM 0.33.0's own files
        # for a pristine tree beside the patched one (about 1 MiB).
        tar.add(site_packages / ".k3_sppp", ".k3_sppp")
    return buffer.getvalue()


def wheel_pins() -> list[str]:
    return [f"{name}=={metadata.version(name)}" for name in WHEELS]


def fetch_wheels(cache: Path) -> list[Path]:
    """Python 3.12 manylinux wheels of :data:`WHEELS`, downloaded once."""
    cache.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for pin in wheel_pins():
        name = pin.split("==")[0].replace("-", "_")
        if not any(cache.glob(f"{name}-*.whl")):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--python-version",
                    "3.12",
                    "--implementation",
                    "cp",
                    *platforms,
                    "-d",
                    str(cache),
                    pin,
                ],
                check=True,
            )
    return sorted(cache.glob("*.whl"))


def build(out: Path, site_packages: Path, wheels: list[Path]) -> dict:
    """Write the bundle to ``out`` (replacing it) and return its manifest."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "vllm-src.tar.xz").write_bytes(vllm_source_tar(site_packages))
    (out / "wheels").mkdir()
    for wheel in wheels:
        shutil.copy2(wheel, out / "wheels" / wheel.name)
    for entry in TESTS:
        source = PROJECT_DIR / entry
        if source.is_dir():
            shutil.copytree(
                source, out / entry, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            (out / entry).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, out / entry)
    shutil.copy2(PROJECT_DIR / "tests/gpu/entry.py", out / "run.py")
    manifest = {
        "vllm": metadata.version("vllm"),
        "wheels": [wheel.name for wheel in wheels],
        "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if manifest["bytes"] > MAX_BYTES:
        raise SystemExit(
            f"gpu-bundle: {manifest['bytes']} bytes, over the {MAX_BYTES} limit"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROJECT_DIR / "build/gpu-bundle")
    parser.add_argument("--no-wheels", action="store_true")
    args = parser.parse_args(argv)
    import vllm

    site_packages = Path(vllm.__file__).resolve().parent.parent
    wheels = [] if args.no_wheels else fetch_wheels(PROJECT_DIR / "build/gpu-wheels")
    manifest = build(args.out, site_packages, wheels)
    print(f"gpu-bundle: {args.out} ({manifest['bytes'] / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
