# SPDX-License-Identifier: Apache-2.0
"""Every option of the evaluation tools says in `--help` what it is for."""

from __future__ import annotations

import argparse

import pytest

from eval import bench, buffer_report, comm_report, evaluate, gsm8k, nccl_bench, serve


class Parsed(Exception):
    """Raised instead of parsing: carries the parser that was asked."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``main`` builds, caught as it starts parsing."""

    def catch(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Parsed) as caught:
        main([])
    return caught.value.parser


def options(parser: argparse.ArgumentParser):
    """Every option of ``parser`` and of its sub-commands, by the command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for command, option in options(sub):
                    yield f"{name} {command}".strip(), option
        elif not isinstance(action, argparse._HelpAction):
            yield "", action


@pytest.mark.parametrize(
    "tool",
    [bench, buffer_report, comm_report, evaluate, gsm8k, nccl_bench, serve],
    ids=lambda m: m.__name__,
)
def test_every_option_has_a_help_text(tool, monkeypatch):
    parser = parser_of(tool.main, monkeypatch)
    silent = [
        f"{command} {'/'.join(action.option_strings) or action.dest}".strip()
        for command, action in options(parser)
        if not (action.help or "").strip()
    ]
    assert silent == []
    assert len(list(options(parser))) >= 3  # the parser, not an empty one
