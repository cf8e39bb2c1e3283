"""The unit tier, marked by its location: a test here starts no process, opens no server and
loads no model from disk (tiny models built in memory are fine).

An autouse fixture turns each of those into an error that names where the test belongs:
tests/stages/<stage>/ or tests/e2e/. The same guard wraps each test's set-up, so fixtures of
wider scope that a unit test pulls in are held to it too.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import socket
import subprocess

import pytest

MOVE = "tests/unit starts no process, opens no server and loads no model: move this test to "
MOVE += "tests/stages/<stage>/ or tests/e2e/"


class NotAUnitTest(RuntimeError):
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise NotAUnitTest(f"{what}: {MOVE}")

    return refuse


def _targets() -> list[tuple[object, str, object]]:
    from transformers import PreTrainedModel

    out = [(subprocess.Popen, "_execute_child", _refuse("a process (subprocess)"))]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            out.append((os, name, _refuse(f"a process (os.{name})")))
    out.append(
        (multiprocessing.process.BaseProcess, "start", _refuse("a process (multiprocessing)"))
    )
    out.append((socket.socket, "listen", _refuse("a server (socket.listen)")))
    load = classmethod(_refuse("a model from disk (from_pretrained)"))
    out.append((PreTrainedModel, "from_pretrained", load))
    return out


_saved: list[tuple[object, str, object]] = []
_depth = [0]


@contextlib.contextmanager
def guard():
    """Refuse processes, servers and model loads inside the block (nests: the outermost block
    restores them)."""
    if _depth[0] == 0:
        for obj, name, refuse in _targets():
            _saved.append((obj, name, vars(obj).get(name)))
            setattr(obj, name, refuse)
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if _depth[0] == 0:
            while _saved:
                obj, name, old = _saved.pop()
                if old is None:  # inherited (socket.socket.listen)
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with guard():  # fixtures of any scope that a unit test sets up
        return (yield)


@pytest.fixture(autouse=True)
def _unit_tier():
    with guard():  # the test itself, to its teardown
        yield
