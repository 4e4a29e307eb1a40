# SPDX-License-Identifier: Apache-2.0
"""The CPU platform's Triton refusal, answered for the tests' CPU ranks.

vLLM 0.34.0's ``CpuPlatform.check_and_update_config`` refuses an x86 host
without Triton's CPU backend ("vLLM on x86 CPUs requires Triton
(triton-cpu).") whenever a ``VllmConfig`` is built. The wheel these tests
install is vLLM's CUDA wheel: it brings Triton without a CPU backend, so
``HAS_TRITON`` is false on a host without a GPU, and no config could be built.
Nothing the test bed runs launches a Triton kernel (its attention and MoE are
CPU stand-ins, the serving tests' runner is one too), so the check is
answered as if triton-cpu were installed, for that check only:
``vllm.triton_utils.HAS_TRITON`` reads true while it runs and is restored
after. vLLM 0.33.0 has no such check, and there this changes nothing.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

__all__ = ["accept_x86_without_triton"]


def accept_x86_without_triton() -> None:
    """Let this process build configs on the CPU platform without Triton's
    CPU backend (see the module docstring); idempotent."""
    check = CpuPlatform.check_and_update_config
    if getattr(check, "accepts_x86_without_triton", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        import vllm.triton_utils as triton_utils

        has_triton = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            check(vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    check_and_update_config.accepts_x86_without_triton = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
