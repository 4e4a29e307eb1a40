# SPDX-License-Identifier: Apache-2.0
"""lm-eval's own command line, as ``python -m lm_eval`` runs it, for
eval.gsm8k: the same arguments, the same outputs, with one difference. A run
given ``--include_path`` looks its tasks up in that path alone.

lm-eval's command line always indexes its built-in tasks besides any
``--include_path`` (about 14,000 YAML files: some 10 CPU-seconds before the
first request, on every run), and has no option to leave them out; its
``TaskManager`` has one, ``include_defaults``, which this sets to false where
the run names an include path. eval.gsm8k passes ``--include_path`` only for
the local task (``--data``, ``GSM8K_DATA=``), whose YAML includes lm-eval's
own ``gsm8k.yaml`` by its absolute path: the built-in index holds nothing that
task reads. Without ``--include_path`` (the Hub's ``gsm8k``), or with an
lm-eval whose ``TaskManager`` has no such parameter, nothing is changed.

    python -m eval.lm_eval_run ARGS...   # as python -m lm_eval ARGS...
"""

from __future__ import annotations

import inspect
import sys


def narrow_to_include_path() -> bool:
    """Make every ``TaskManager`` given an include path index that path
    alone. Returns whether this lm-eval allowed it."""
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__
    if "include_defaults" not in inspect.signature(init).parameters:
        return False

    def narrowed(self, *args, include_path=None, include_defaults=True, **kwargs):
        init(
            self,
            *args,
            include_path=include_path,
            include_defaults=include_defaults and not include_path,
            **kwargs,
        )

    TaskManager.__init__ = narrowed
    return True


def main(argv: list[str]) -> None:
    if any(arg.split("=")[0] == "--include_path" for arg in argv):
        narrow_to_include_path()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
