# SPDX-License-Identifier: Apache-2.0
"""The GPU bundle (``make gpu-bundle``) builds without a GPU, fits what the
device tool carries, holds what the device run needs, and its entry script
refuses where there is no GPU."""

import subprocess
import sys
import tarfile

import pytest

from eval import gpu_bundle
from tests.tooling.conftest import BASE


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu-bundle"
    gpu_bundle.main(["--out", str(out), "--no-wheels"])
    return out


def test_bundle_fits_what_the_device_carries(bundle):
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size <= gpu_bundle.MAX_BYTES


def test_bundle_holds_patched_sources_and_no_compiled_libraries(bundle):
    with tarfile.open(bundle / "vllm-src.tar.xz") as tar:
        names = tar.getnames()
    assert "vllm/v1/worker/pp_intermediate_tensors.py" in names  # the overlay
    assert "vllm/v1/worker/gpu/cudagraph_utils.py" in names
    assert any(n.startswith(f"vllm-{BASE}.dist-info/") for n in names)
    assert ".k3_sppp/journal.json" in names  # the revision the stages announce
    assert not [n for n in names if n.endswith(".so")]
    for path in (
        "run.py",
        "tests/gpu/standins.py",
        "tests/gpu/checks.py",
        "tests/sppp_testbed/tiny_k3.py",
        "tests/__init__.py",
    ):
        assert (bundle / path).is_file(), path


def test_wheels_are_pinned_to_the_venv_versions():
    pins = gpu_bundle.wheel_pins()
    assert len(pins) == len(gpu_bundle.WHEELS)
    assert all("==" in pin and pin.split("==")[1] for pin in pins)


def test_entry_script_refuses_without_a_gpu(bundle):
    run = subprocess.run(
        [sys.executable, str(bundle / "run.py"), "graphs"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "refusing: torch sees no CUDA GPU here" in run.stderr
