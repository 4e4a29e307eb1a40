# SPDX-License-Identifier: Apache-2.0
"""Which vLLM release the tests run on, for the proofs that hold on one only.

The series is kept for vLLM 0.34.0 (the default) and 0.33.0. A test of what
one release has and the other lacks (0.33.0's legacy model runner, 0.34.0's
DSA layers and shard-sized MegaMoE buffer) is skipped on the other release
with a reason that names the release it runs on, never passed there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm

if TYPE_CHECKING:  # pytest only where a mark is asked for: the GPU bundle
    import pytest  # carries the test bed without it

__all__ = [
    "VLLM_VERSION",
    "HAS_LEGACY_RUNNER",
    "only_on_0_33",
    "only_from_0_34",
]


def _release(version: str) -> tuple[int, int, int]:
    """``0.34.0`` (or ``0.34.0+cu130``, ``0.34.0rc1``) as ``(0, 34, 0)``."""
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    return (*parts, 0, 0, 0)[:3]  # type: ignore[return-value]


VLLM_VERSION = _release(vllm.__version__)

# vLLM 0.34.0 deleted the legacy runner (vllm/v1/worker/gpu_model_runner.py)
# and its CudagraphDispatcher: Model Runner V2 only.
HAS_LEGACY_RUNNER = VLLM_VERSION < (0, 34, 0)


def only_on_0_33(what: str) -> pytest.MarkDecorator:
    """Skip unless this is vLLM 0.33.0, saying what 0.34.0 no longer has."""
    import pytest

    return pytest.mark.skipif(
        VLLM_VERSION[:2] != (0, 33),
        reason=f"vLLM 0.33.0 only: {what} (this is vLLM {vllm.__version__})",
    )


def only_from_0_34(what: str) -> pytest.MarkDecorator:
    """Skip on releases before 0.34.0, saying what they do not have."""
    import pytest

    return pytest.mark.skipif(
        VLLM_VERSION < (0, 34, 0),
        reason=f"vLLM 0.34.0 only: {what} (this is vLLM {vllm.__version__})",
    )
