# SPDX-License-Identifier: Apache-2.0
"""A vLLM general plugin of the test servers: EngineCore and the worker
processes are forked, as vLLM starts them on a GPU node, instead of spawned;
vLLM 0.34.0's CPU platform builds their configs without triton-cpu; and a
server started with ``ASYNC_SCHEDULING`` set keeps async scheduling on.

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

``CpuPlatform.check_and_update_config`` also turns async scheduling off
("not required on CPU"); on a GPU node it is on by default. The serving
tests' drafter layouts need it at PP > 1: with it off, vLLM 0.34.0's
EngineCore hands the scheduler the V2 runner's drafts after every step it
submits (``EngineCore.post_step``, ``v1/engine/core.py:749-756``), which the
V2 runner keeps on the worker and answers with -1 placeholders
(``DraftTokensHandler.get_draft_tokens``,
``v1/worker/gpu/spec_decode/utils.py:113-138``); under the PP batch queue
the scheduler then schedules the request again while its step is still in
flight, its sampled token not yet appended: two tokens with two placeholder
drafts for a 1-token prompt's first decode
(``v1/core/sched/scheduler.py:855-859`` and
``1026-1037``), which the V2 runner refuses (``assert
(num_scheduled_tokens_np >= num_logits).all()``,
``v1/worker/gpu/model_runner.py:1516``; seen on TP2xPP3, 2026-12-03). Where
``ASYNC_SCHEDULING`` is set in a server's environment
(``tests/serving/conftest.py`` sets it for the drafter layouts, which also
pass ``--async-scheduling``), every process of that server keeps async
scheduling on, as a GPU node does.

vLLM loads the plugin (``load_general_plugins``) in the API server before
it builds the config, in EngineCore before it starts the executor and in
every worker; ``tests/serving/plugins`` on ``PYTHONPATH`` holds its entry
point.
"""

from __future__ import annotations

import os

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
# Read by this plugin only: set, the CPU platform's config check leaves
# async scheduling on.
ASYNC_SCHEDULING = "K3_SPPP_TEST_ASYNC_SCHEDULING"


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
        if os.environ.get(ASYNC_SCHEDULING):
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.forks = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    os.environ[START_METHOD] = "fork"
