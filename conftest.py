# SPDX-License-Identifier: Apache-2.0
"""Every test here runs on the CPU: vLLM must pick its CPU platform before
its first import, in this process and in every rank process it spawns. The
upstream-bound tests under vllm_overlay/tests rely on this too; they use no
device, so in vLLM's own CI they run on whatever platform it has."""

import os

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# Importing vLLM imports humming, which starts two interpreters in the
# background to pre-build its CUDA launcher: on a CPU they only take cores
# from the tests (every process importing vLLM starts its own two).
os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"
# vLLM's few torch.compile'd helpers (the vocab-parallel embedding mask,
# SiluAndMul's native path) would compile in every rank process: on 2 CPU
# cores that doubled the distributed tests' time (79 s against 35 s) and says
# nothing of the GPU graphs. They run eagerly here; TORCHDYNAMO_DISABLE=0
# compiles them again.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
