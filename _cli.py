"""The command line of apply.py: the layer above the tool and its upstream half.

``_apply.py`` keeps the tree safe (apply, revert, status, check, export of
one diff, manifest, devtree, refresh); ``_upstream.py`` builds on it (the
pull requests, rebase). This module parses the command line and picks the
command from either, so each imports only downward:
``apply.py`` -> ``_cli.py`` -> ``_upstream.py`` -> ``_apply.py``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path

from _apply import (
    EXIT_CTRL_C,
    EXIT_ERROR,
    EXIT_OK,
    HELP_DESCRIPTION,
    HELP_EPILOG,
    PROJECT_DIR,
    ApplyError,
    cmd_apply,
    cmd_check,
    cmd_devtree,
    cmd_manifest,
    cmd_refresh,
    cmd_revert,
    cmd_status,
    command_line,
    load_patch_set,
    require_clean,
    resolve_target,
    say,
    series_prefix_problem,
    tell,
)
from _apply import cmd_export as cmd_export_series
from _upstream import cmd_export_pulls, cmd_rebase, pulls_problem


def cmd_export(args: argparse.Namespace) -> int:
    if args.pulls is not None:
        return cmd_export_pulls(args)
    return cmd_export_series(args)


def cmd_lint(args: argparse.Namespace) -> int:
    patch_set = load_patch_set(args.patch_set)
    require_clean(patch_set)
    target = resolve_target(args.target, args.patch_set)
    if problem := series_prefix_problem(patch_set, target):
        raise ApplyError(problem)
    if problem := pulls_problem(patch_set, target):
        raise ApplyError(problem)
    say(
        f"{len(patch_set.patches)} patch(es), "
        f"{len(patch_set.overlay_export)} overlay file(s): consistent; "
        "every prefix of the series applies and compiles, and so does each "
        "declared pull request after the ones before it"
    )
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apply.py",
        description=HELP_DESCRIPTION,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--patch-set",
        type=Path,
        default=PROJECT_DIR,
        help="directory holding patches/ and vllm_overlay/ (default: this project)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        text: str,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--target",
            type=Path,
            default=None,
            help="site-packages, venv or vLLM checkout root "
            "(default: this project's .venv)",
        )
        p.set_defaults(func=func)
        return p

    add("apply", cmd_apply, "apply the series and overlay files, all or nothing")
    revert = add("revert", cmd_revert, "restore the original files byte for byte")
    revert.add_argument(
        "--force",
        action="store_true",
        help="also overwrite files edited since apply (each is kept as "
        "FILE.k3-sppp-drift, or .1, .2, ... beside an earlier one)",
    )
    revert.add_argument(
        "--any-version",
        action="store_true",
        help="restore even if the target's vLLM version is not the one the "
        "patch set was applied to",
    )
    add("status", cmd_status, "what is applied where, and any drift").add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead (schema: docs/apply-tool.md)",
    )
    add("check", cmd_check, "dry run: name every patch and hunk that fails")
    export = add("export", cmd_export, "one unified diff for an upstream pull request")
    export.add_argument(
        "-o", "--output", type=Path, help="write here instead of standard output"
    )
    export.add_argument(
        "--pulls",
        type=Path,
        metavar="DIR",
        help="instead: one diff and description per pull request that "
        "patches/pull-requests.ini declares, in order, into DIR",
    )
    add(
        "manifest",
        cmd_manifest,
        "regenerate patches/base.sha256 from the wheel's RECORD and "
        "patches/patched.sha256 from the series applied to those originals",
    )
    add(
        "lint",
        cmd_lint,
        "check the series, headers and manifest, and that every prefix of "
        "the series applies to the pinned sources",
    )
    add(
        "devtree", cmd_devtree, "git repo of pristine sources, one commit per patch"
    ).add_argument("dir", type=Path)
    add("refresh", cmd_refresh, "write patches/ back from a devtree").add_argument(
        "dir", type=Path
    )
    rebase = add(
        "rebase",
        cmd_rebase,
        "apply the series three-way to another vLLM tree and write the patch "
        "set for it (--target: where the pinned originals are)",
    )
    rebase.add_argument(
        "--onto",
        type=Path,
        required=True,
        metavar="TREE",
        help="the vLLM to move the series onto (as --target takes it)",
    )
    rebase.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="where the rebased patch set goes (absent or empty)",
    )
    rebase.add_argument(
        "--onto-version", help="TREE's vLLM version, where TREE does not say it"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: runs one command and returns its exit code.

    Whatever fails while an error is reported (an I/O error on standard
    error, a Ctrl-C while printing) leaves the code of what happened, never
    a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ApplyError as e:
        code, message = e.code, f"error: {e}"
    except OSError as e:
        # Every write into vllm/ is inside a transaction that turns its own
        # errors into an ApplyError; what reaches here changed no vLLM file.
        code, message = EXIT_ERROR, f"error: {e}"
    except KeyboardInterrupt:
        status_command = command_line(args.patch_set, args.target, "status")
        code = EXIT_CTRL_C
        message = (
            f"interrupted; `{status_command}` says where it stopped and which "
            "command finishes it"
        )
    with contextlib.suppress(KeyboardInterrupt):
        tell(f"apply.py {args.command}: {message}", "stderr")
    return code
