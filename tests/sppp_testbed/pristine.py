# SPDX-License-Identifier: Apache-2.0
"""The installed vLLM release as it was before the patch set, without copying it.

Every file of the ``vllm/`` package this interpreter imports (0.34.0 in
``.venv``, 0.33.0 in ``.venv-0.33.0``) is linked; the files the journal says
were patched link to their hash-keyed backups, and overlay files are left
out. Ranks started with ``RankPool(vllm_root=...)`` import this tree,
so the same test bed runs patched and unpatched vLLM side by side.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import apply


def installed_vllm_root() -> Path:
    """The directory holding the ``vllm/`` package this interpreter imports
    (not necessarily this project's default ``.venv``)."""
    spec = find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return Path(spec.origin).resolve().parent.parent


def link_pristine_vllm(dest: Path) -> Path:
    """Build the tree under ``dest``; return the directory to put on sys.path."""
    root = apply.target_root(installed_vllm_root())
    source = apply.original_files(root)
    for directory, subdirs, files in os.walk(root / "vllm"):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        for name in files:
            rel = str((Path(directory) / name).relative_to(root))
            original = source(rel)
            if original is None:
                continue  # an overlay file: not part of the release
            link = dest / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(original.resolve())
    return dest


def start_as_node(kinds: list) -> tuple[str | None, float]:
    """A stage of a mixed pool: "pristine" runs the release's own worker,
    which checks nothing before its first PP receive; any other kind is a stage of
    ``test_pp_stage_announcement``. Importable from either tree."""
    from vllm.distributed.parallel_state import get_pp_group

    if kinds[get_pp_group().rank_in_group] == "pristine":
        assert find_spec("vllm.v1.worker.pp_hand_off_agreement") is None
        return None, 0.0
    from tests.distributed.test_pp_stage_announcement import start_as

    return start_as(kinds)
