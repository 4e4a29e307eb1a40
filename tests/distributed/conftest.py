# SPDX-License-Identifier: Apache-2.0
"""Distributed tests run vLLM's distributed layer on the CPU, over gloo."""

import os

# Before any vLLM import, here and in every spawned rank (which inherits it).
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
