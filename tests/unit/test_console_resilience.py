"""A reader that leaves (`| head`) and a Ctrl-C delivered twice (GNU timeout) are not
the user's intent to end a run."""

from __future__ import annotations

import io
import os
import signal
import sys

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from meshforge.cli.stdout import StdoutThatMayClose, stdout_may_close
from meshforge.launch import ctrl_c
from meshforge.launch.ctrl_c import CtrlC


class _PipeWithoutReader(io.StringIO):
    """A text stream whose reader has gone after `lines` writes, on a real descriptor."""

    def __init__(self, fd: int, lines: int) -> None:
        super().__init__()
        self._fd, self._left = fd, lines

    def write(self, text: str) -> int:
        if self._left == 0:
            raise BrokenPipeError(32, "Broken pipe")
        self._left -= 1
        return super().write(text)

    def fileno(self) -> int:
        return self._fd


def test_writes_after_the_reader_left_go_nowhere_and_raise_nothing(tmp_path):
    target = tmp_path / "fd-target"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        inner = _PipeWithoutReader(fd, lines=1)
        out = StdoutThatMayClose(inner)
        assert out.write("step 1\n") == 7
        assert not out.gone
        assert out.write("step 2\n") == 7  # the reader left: no exception
        assert out.gone
        out.flush()
        out.write("step 3\n")
        assert inner.getvalue() == "step 1\n"
        os.write(fd, b"after")  # the descriptor now points at /dev/null
        assert target.read_bytes() == b""
    finally:
        os.close(fd)


def test_stdout_is_wrapped_for_the_call_and_restored_after():
    before = sys.stdout
    with stdout_may_close():
        assert isinstance(sys.stdout, StdoutThatMayClose)
        with stdout_may_close():  # nested (a command calling main): wrapped once
            assert not isinstance(sys.stdout._stream, StdoutThatMayClose)
    assert sys.stdout is before


def test_a_ctrl_c_delivered_twice_at_once_is_one_press(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ctrl_c.time, "monotonic", lambda: now[0])
    killed = []
    monkeypatch.setattr(ctrl_c, "kill_workers", lambda: killed.append(1) or True)
    press = CtrlC()
    with pytest.raises(SignalException):
        press._on_sigint(signal.SIGINT, None)
    now[0] += ctrl_c.SAME_PRESS_S / 10  # timeout's second delivery, to the group
    press._on_sigint(signal.SIGINT, None)
    assert press.presses == 1 and not killed and not press.killed
    now[0] += ctrl_c.SAME_PRESS_S  # a person's second press
    press._on_sigint(signal.SIGINT, None)
    assert press.presses == 2 and killed and press.killed
