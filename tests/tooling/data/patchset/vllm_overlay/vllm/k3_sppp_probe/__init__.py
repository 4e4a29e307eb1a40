# SPDX-License-Identifier: Apache-2.0
"""New module installed by the k3-sppp tooling tests' own patch set."""

PROBE = "overlay"
