"""The command line of apply.py: the layer above the tool and its upstream half.

``_apply.py`` keeps the tree safe (apply, revert, status, check, export of
one diff, manifest, devtree, refresh); ``_upstream.py`` builds on it (the
pull requests, rebase). This module parses the command line and picks the
command from either, so each imports only downward:
``apply.py`` -> ``_cli.py`` -> ``_upstream.py`` -> ``_apply.py``.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import filecmp
from collections.abc import Callable
from pathlib import Path

from _apply import (
    BASES,
    EXIT_CTRL_C,
    EXIT_ERROR,
    EXIT_OK,
    HELP_DESCRIPTION,
    HELP_EPILOG,
    PROJECT_DIR,
    ApplyError,
    Target,
    cmd_apply,
    cmd_check,
    cmd_devtree,
    cmd_manifest,
    cmd_refresh,
    cmd_revert,
    cmd_status,
    command_line,
    kept_versions,
    load_patch_set,
    overlay_files,
    pristine_sources,
    project_venv,
    resolve_target,
    say,
    series_dirs,
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
    """Every series of the patch set, each against a pristine tree of its own
    vLLM (``lint_trees``), and what the series share (``bases_problems``)."""
    root = args.patch_set
    dirs = series_dirs(root)
    # One series needs no version to be chosen: its own problems name it.
    kept = kept_versions(root) if len(dirs) > 1 else {"": dirs[0]}
    trees = lint_trees(root, kept, args.target or [])
    problems = bases_problems(root, kept)
    done = []
    for version, patch_dir in kept.items():
        patch_set = load_patch_set(root, patch_dir)
        if patch_set.problems:
            problems += patch_set.problems
            continue
        target = trees[version]
        try:
            problem = series_prefix_problem(patch_set, target) or pulls_problem(
                patch_set, target
            )
        except ApplyError as e:
            problem = str(e)
        if problem:
            problems.append(f"{patch_set.describe()}, on {target.root}: {problem}")
        else:
            done.append(
                f"{patch_set.describe()}, on {target.root}: "
                f"{len(patch_set.patches)} patch(es), "
                f"{len(patch_set.overlay_export)} overlay file(s): consistent"
            )
    if problems:
        raise ApplyError("the patch set is inconsistent:\n  " + "\n  ".join(problems))
    say(
        "\n".join(done) + "\nin each series every prefix applies and compiles on "
        "its pristine vLLM, and so does each declared pull request after the "
        "ones before it"
    )
    return EXIT_OK


def lint_trees(
    root: Path, kept: dict[str, Path], given: list[Path]
) -> dict[str, Target]:
    """The pristine tree each series is linted against: a ``--target`` of
    its vLLM version, else this project's venv of that version (``.venv``
    for the default series, ``.venv-VERSION`` for another base), else the
    Python sources of that version's wheel that `make pristine` unpacked
    (``pristine_sources``).  A patch
    set of one series takes the one ``--target`` given (default: the default
    target), whatever it says, as apply does."""
    targets = [resolve_target(path, root) for path in given]
    if len(kept) == 1:
        if len(targets) > 1:
            raise ApplyError(f"{root} keeps one series; lint it against one --target")
        version = next(iter(kept))
        return {version: targets[0] if targets else resolve_target(None, root)}
    trees: dict[str, Target] = {}
    for target in targets:
        version = target.version()
        if version not in kept:
            raise ApplyError(
                f"{target.root}: vLLM {version or '(no version stated)'}, but "
                f"{root} keeps a series for vLLM {', '.join(kept)}; pass a "
                "pristine tree of one of those"
            )
        trees[version] = target
    missing = []
    for version, patch_dir in kept.items():
        if version in trees:
            continue
        venv, wheel_tree = project_venv(version), pristine_sources(version)
        for tree in (venv, wheel_tree):
            if tree.is_dir():
                target = resolve_target(tree, root)
                if target.version() == version:
                    trees[version] = target
                    break
        else:
            missing.append(
                f"vLLM {version} ({patch_dir}): no vLLM {version} venv at {venv} "
                f"(`make setup BASE={version}` builds it), no sources of its "
                f"wheel at {wheel_tree} (`make pristine` unpacks them), and no "
                f"--target of vLLM {version} was given"
            )
    if missing:
        raise ApplyError(
            "lint checks every series against a pristine tree of its vLLM; "
            "missing:\n  " + "\n  ".join(missing)
        )
    return trees


def bases_problems(root: Path, kept: dict[str, Path]) -> list[str]:
    """What the series of one patch set must agree on: setup.cfg's
    ``vllm_bases`` lists every one, and a base's own overlay files each
    differ from the shared file they replace (else the shared one serves)."""
    problems = []
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    listed = config.get("k3_sppp", "vllm_bases", fallback=None)
    if listed is not None and sorted(listed.split()) != sorted(kept):
        problems.append(
            f"{root / 'setup.cfg'}: vllm_bases = {listed}, but {root} keeps a "
            f"series for vLLM {' '.join(kept)} (patches/ and {BASES}/VERSION/"
            "patches/); make them agree"
        )
    shared = root / "vllm_overlay"
    for version, patch_dir in kept.items():
        own = patch_dir.parent / "vllm_overlay"
        if patch_dir == root / "patches":
            if (root / BASES / version).exists():
                problems.append(
                    f"{root / BASES / version}: vLLM {version} is the default "
                    "series' (patches/base.version); a base directory is for "
                    "another vLLM"
                )
            continue
        for rel in overlay_files(own):
            if (shared / rel).is_file() and filecmp.cmp(
                own / rel, shared / rel, shallow=False
            ):
                problems.append(
                    f"{own / rel}: the same as {shared / rel}; delete it (a "
                    "base keeps only the overlay files it needs otherwise)"
                )
    return problems


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
        help="directory holding patches/ (and bases/VERSION/patches/ for other "
        "vLLMs) and vllm_overlay/ (default: this project); the target's vLLM "
        "version picks the series",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        text: str,
        target_help: str = "site-packages, venv or vLLM checkout root "
        "(default: this project's .venv; .venv-VERSION when apply.py runs "
        "with that venv's Python); its vLLM version chooses the series",
        many: bool = False,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--target",
            type=Path,
            default=None,
            action="append" if many else "store",
            help=target_help,
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
        "regenerate the manifests of the target's series (patches/ or "
        "bases/VERSION/patches/): base.sha256 from the wheel's RECORD, "
        "patched.sha256 from the series applied to those originals",
    )
    add(
        "lint",
        cmd_lint,
        "check every series, its headers and manifests, and that every "
        "prefix of each applies to its pinned sources",
        target_help="a pristine tree for one series, by its vLLM version "
        "(repeat for each; default: .venv for the default series, "
        ".venv-VERSION for another base)",
        many=True,
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
    # Absolute, so that a path relative to the caller's directory still
    # names its patches when git runs elsewhere.
    args.patch_set = args.patch_set.resolve()
    try:
        return args.func(args)
    except ApplyError as e:
        code, message = e.code, f"error: {e}"
    except OSError as e:
        # Every write into vllm/ is inside a transaction that turns its own
        # errors into an ApplyError; what reaches here changed no vLLM file.
        code, message = EXIT_ERROR, f"error: {e}"
    except KeyboardInterrupt:
        target = None if isinstance(args.target, list) else args.target
        status_command = command_line(args.patch_set, target, "status")
        code = EXIT_CTRL_C
        message = (
            f"interrupted; `{status_command}` says where it stopped and which "
            "command finishes it"
        )
    with contextlib.suppress(KeyboardInterrupt):
        tell(f"apply.py {args.command}: {message}", "stderr")
    return code
