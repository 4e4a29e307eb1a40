# SPDX-License-Identifier: Apache-2.0
"""k3-sppp only, never upstream: the series revision in the PP stages'
announcement.

Upstream every node of a deployment runs one vLLM build, and
``pp_hand_off_agreement.stage_build`` names it. Here two nodes can run the
same vLLM with different revisions of the series, so this fills that seam
with the revision ``make status`` prints too, read from the journal ``make
apply`` wrote beside the ``vllm`` package: the installed bytes do not depend
on it. Imported at the end of ``gpu_worker.py`` (patch 0006).
"""

import json
from pathlib import Path

import vllm
from vllm.v1.worker import pp_hand_off_agreement

JOURNAL = Path(vllm.__file__).parent.parent / ".k3_sppp" / "journal.json"
CHECK = "run `make status` on each node and `make apply` from one k3-sppp checkout"

vllm_build = pp_hand_off_agreement.stage_build


def series_revision() -> str:
    """The revision apply recorded, or ``unknown`` where no journal says
    ``applied``."""
    try:
        data = json.loads(JOURNAL.read_text())
    except (OSError, ValueError):
        return "unknown"
    if not isinstance(data, dict) or data.get("state") != "applied":
        return "unknown"
    return str(data.get("revision", "unknown"))


def stage_build() -> str:
    return f"{vllm_build()}, k3-sppp revision {series_revision()} ({CHECK})"


pp_hand_off_agreement.stage_build = stage_build
