# SPDX-License-Identifier: Apache-2.0
"""A vLLM general plugin of the test servers: EngineCore and the worker
processes are forked, as vLLM starts them on a GPU node, instead of spawned;
and vLLM 0.34.0's CPU platform builds their configs without triton-cpu.

``CpuPlatform.check_and_update_config`` sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whenever a process builds its config.
A spawned process imports vLLM and torch again (15 to 20 s of CPU each, five
of them per TP2xPP2 server); a forked one inherits them from its parent. On
a GPU node vLLM forks unless CUDA is already initialised, which it is not
when the API server starts EngineCore nor when EngineCore starts the
workers: forking is the start-up a cluster runs.

vLLM 0.34.0's ``CpuPlatform.check_and_update_config`` refuses an x86 host
without Triton's CPU backend, which the CUDA wheel these tests install lacks;
no process of a server could build its config.
:func:`tests.sppp_testbed.cpu_platform.accept_x86_without_triton` answers
that check alone (its docstring says why nothing here needs Triton), in each
process that builds a config: the API server, EngineCore and the workers.
On vLLM 0.33.0, which has no such check, it changes nothing.

vLLM loads the plugin (``load_general_plugins``) in the API server before
it builds the config, in EngineCore before it starts the executor and in
every worker; ``tests/serving/plugins`` on ``PYTHONPATH`` holds its entry
point.
"""

from __future__ import annotations

import os

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def register() -> None:
    from tests.sppp_testbed.cpu_platform import accept_x86_without_triton
    from vllm.platforms.cpu import CpuPlatform

    accept_x86_without_triton()

    check = CpuPlatform.check_and_update_config
    if getattr(check, "forks", False):  # loaded once per process, but be sure
        return

    def check_and_update_config(cls, vllm_config) -> None:
        check(vllm_config)
        os.environ[START_METHOD] = "fork"

    check_and_update_config.forks = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    os.environ[START_METHOD] = "fork"
