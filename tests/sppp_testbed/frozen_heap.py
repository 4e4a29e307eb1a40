# SPDX-License-Identifier: Apache-2.0
"""Imported last by a fork server (``launcher.FORK_SERVER_PRELOAD``): what
the server imported leaves the garbage collector's sight, so a forked rank's
full collections (vLLM's ``DeviceMemoryProfiler`` runs two per model load)
walk only what the rank made itself, instead of the whole inherited heap,
writing to, and so copying, every page of it that it could have shared."""

import gc

gc.freeze()
