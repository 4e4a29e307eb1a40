# SPDX-License-Identifier: Apache-2.0
"""A vLLM 0.33.0 tree as it was before the patch set, without copying it.

Every file of the installed ``vllm/`` package is linked; the files the
journal says were patched link to their hash-keyed backups, and overlay files
are left out. Ranks started with ``RankPool(vllm_root=...)`` import this tree,
so the same test bed runs patched and unpatched vLLM side by side.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import apply


def link_pristine_vllm(dest: Path) -> Path:
    """Build the tree under ``dest``; return the directory to put on sys.path."""
    root = apply.target_root()
    source = apply.original_files(root)
    for directory, subdirs, files in os.walk(root / "vllm"):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        for name in files:
            rel = str((Path(directory) / name).relative_to(root))
            original = source(rel)
            if original is None:
                continue  # an overlay file: not part of vLLM 0.33.0
            link = dest / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(original.resolve())
    return dest


def start_as_node(kinds: list) -> tuple[str | None, float]:
    """A stage of a mixed pool: "pristine" runs vLLM 0.33.0's worker, which
    checks nothing before its first PP receive; any other kind is a stage of
    ``test_pp_stage_announcement``. Importable from either tree."""
    from vllm.distributed.parallel_state import get_pp_group

    if kinds[get_pp_group().rank_in_group] == "pristine":
        assert find_spec("vllm.v1.worker.pp_stage_announcement") is None
        return None, 0.0
    from tests.distributed.test_pp_stage_announcement import start_as

    return start_as(kinds)
