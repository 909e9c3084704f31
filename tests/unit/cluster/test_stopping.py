"""Stop signals: the first asks for a stop, the second stops at once, ignored ones stay ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.run.stopping import JobStopped, stop_on_signals
from tasks.scoring import children_ignore_sigint


@pytest.fixture(autouse=True)
def sigint_as_at_a_terminal():
    """Python's own SIGINT handler, as a process started at a terminal has: a test run started in the
    background (`cmd &` in a script) inherits SIGINT ignored, which these tests must not depend on."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _deliver(number: int) -> None:
    """Send a signal to this process and give Python a bytecode boundary to run its handler."""
    os.kill(os.getpid(), number)
    time.sleep(0.01)


def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once():
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals() as stop:
        assert not stop.requested
        _deliver(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            _deliver(signal.SIGINT)
        # after the second signal the handlers are the caller's again
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
    assert {number: signal.getsignal(number) for number in before} == before


def test_handlers_are_restored_after_a_run_that_was_not_stopped():
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals() as stop:
        assert signal.getsignal(signal.SIGINT) is not before
    assert not stop.requested and signal.getsignal(signal.SIGINT) is before


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # how a shell starts a background job
    try:
        with stop_on_signals() as stop:
            _deliver(signal.SIGINT)
            assert not stop.requested
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_stop_message_says_how_to_continue_and_exits_as_the_shell_reports_a_signal(tmp_path):
    stopped = JobStopped("SIGINT", 7, tmp_path / "checkpoints" / "step-000007", tmp_path)
    assert stopped.exit_code == 130
    assert f"stableasync train --resume {tmp_path}" in str(stopped) and "after step 7" in str(stopped)
    assert JobStopped("SIGTERM", 1, tmp_path, tmp_path).exit_code == 143


def _ignores_sigint(pid: int) -> bool:
    ignored = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def test_processes_started_under_children_ignore_sigint_outlive_a_ctrl_c():
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    handler = signal.getsignal(signal.SIGINT)
    with children_ignore_sigint():
        immune = subprocess.Popen(sleeper)
    plain = subprocess.Popen(sleeper)
    try:
        assert signal.getsignal(signal.SIGINT) is handler, "the caller's own handler is back"
        assert _ignores_sigint(immune.pid) and not _ignores_sigint(plain.pid)
        time.sleep(0.5)  # let the plain one install Python's KeyboardInterrupt handler
        for process in (immune, plain):
            process.send_signal(signal.SIGINT)
        assert plain.wait(timeout=10) != 0
        time.sleep(0.5)
        assert immune.poll() is None
    finally:
        for process in (immune, plain):
            process.kill()
            process.wait()


def test_signals_taken_over_since_are_taken_back_and_blocked_ones_unblocked():
    """ray.init sets a driver's SIGTERM to sys.exit; a submitted job's driver starts with SIGINT blocked."""
    blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with stop_on_signals() as stop:
            assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
            signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(number))  # what ray.init does
            stop.take_signals()
            _deliver(signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"
            stop.take_signals()  # after a request it leaves the handlers alone: the next signal stops at once
            with pytest.raises(KeyboardInterrupt):
                _deliver(signal.SIGINT)
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()), "the caller's mask is back"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked_before)
