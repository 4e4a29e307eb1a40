# SPDX-License-Identifier: Apache-2.0
"""Upstream-bound test file: travels in the export only, never installed."""

from vllm.k3_sppp_probe import PROBE


def test_probe_is_installed():
    assert PROBE == "overlay"
