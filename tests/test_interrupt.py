"""tahnode.tools.interrupt: SIGTERM and SIGHUP unwind a command as Ctrl-C does (its finally blocks run,
it returns 130), and the handlers before are back afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tahnode.tools.interrupt import STOP_SIGNALS, interruptible, stops_as_interrupt


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_runs_the_commands_finally_and_returns_130(sig, capsys):
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    cleaned = []

    @interruptible("tahnode bench test")
    def main() -> int:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises within this
            return 0
        finally:
            cleaned.append(True)

    assert main() == 130 and cleaned == [True]
    assert "tahnode bench test: interrupted" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_a_command_that_ends_by_itself_returns_its_own_status_and_keeps_nothing_installed():
    before = signal.getsignal(signal.SIGTERM)
    with stops_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert interruptible("x")(lambda: 3)() == 3
    assert signal.getsignal(signal.SIGTERM) is before
