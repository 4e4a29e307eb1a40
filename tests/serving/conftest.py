# SPDX-License-Identifier: Apache-2.0
"""Servers shared by the tests of a module: start-ups are the time cost."""

from __future__ import annotations

import socket

import pytest

from tests.serving.server import write_model_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_model_dir(tmp_path_factory.mktemp("tiny-k3"))
