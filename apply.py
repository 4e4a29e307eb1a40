#!/usr/bin/env python3
"""Apply, revert and inspect the k3-sppp patch set on a vLLM tree.

The entry point: it refuses Pythons older than 3.9 in syntax that every
Python since 2.7 parses, then imports the command line (``_cli.py``) and
the tool's API (``_apply.py``'s ``__all__``, and ``main``).  ``python3
apply.py --help`` says more.
"""

import sys

if sys.version_info < (3, 9):  # noqa: UP036 -- refused before anything is written
    sys.exit(
        "apply.py needs Python 3.9 or newer; "
        + sys.executable
        + " is "
        + sys.version.split()[0]
        + ". Run it with a newer python3."
    )

import _apply  # noqa: E402
from _apply import *  # noqa: E402, F403 -- the API, declared by __all__
from _cli import main  # noqa: E402

__all__ = _apply.__all__ + ["main"]  # syntax Python 2.7 parses

if __name__ == "__main__":
    sys.exit(main())
