"""A submitted job's entrypoint: Ray's stop signal reaches the driver, not the processes under it.

Each test stands in for Ray's job supervisor as it really behaves: it starts the entrypoint in a new
session and stops it by signalling the entrypoint and every process below it by parent pid (psutil),
then SIGKILLs it. The driver here is a small script that starts a service process, as the real driver
starts wandb-core, and records which signals each of them got.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cluster.remote.job_entrypoint import exit_status

SERVICE = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
for number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(number, lambda n, f: (out / "service.got").write_text(signal.Signals(n).name))
(out / "service.pid").write_text(str(__import__("os").getpid()))
while True:
    time.sleep(0.05)
"""

DRIVER = """
import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
service = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(out)])
got = []
signal.signal(signal.SIGINT, lambda n, f: got.append(signal.Signals(n).name))
(out / "driver.pid").write_text(str(os.getpid()))
print("driver started", flush=True)
while not got:
    time.sleep(0.02)
time.sleep(0.5)  # what a stopping driver does meanwhile: its service must still be there for it
(out / "driver.got").write_text(",".join(got))
(out / "service.alive").write_text(str(service.poll() is None))
service.kill()
sys.exit(130)
"""


def _start(out: Path, driver: str = DRIVER) -> subprocess.Popen:
    command = [sys.executable, "-m", "cluster.remote.job_entrypoint", sys.executable, "-c", driver, str(out), SERVICE]
    return subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def _signal_like_ray(entrypoint: subprocess.Popen, number: int) -> None:
    """What Ray's job supervisor does on `ray job stop`: the entrypoint and all its descendants."""
    process = psutil.Process(entrypoint.pid)
    for target in [process, *process.children(recursive=True)]:
        os.kill(target.pid, number)


def _kill_what_is_left(entrypoint: subprocess.Popen, out: Path) -> None:
    """A failing test must not leave the driver or its service running."""
    entrypoint.kill()
    for name in ("driver.pid", "service.pid"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int((out / name).read_text()), signal.SIGKILL)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _running(out: Path) -> Iterator[tuple[subprocess.Popen, int, int]]:
    """The entrypoint with its driver and service started: (entrypoint, driver pid, service pid)."""
    entrypoint = _start(out)
    try:
        _wait_for(out / "service.pid")
        _wait_for(out / "driver.pid")
        yield entrypoint, int((out / "driver.pid").read_text()), int((out / "service.pid").read_text())
    finally:
        _kill_what_is_left(entrypoint, out)


def test_a_stop_reaches_the_driver_and_not_the_service_under_it(tmp_path):
    with _running(tmp_path) as (entrypoint, driver_pid, _):
        assert driver_pid not in {p.pid for p in psutil.Process(entrypoint.pid).children(recursive=True)}
        _signal_like_ray(entrypoint, signal.SIGINT)
        output, _ = entrypoint.communicate(timeout=30)
    assert entrypoint.returncode == 130, output  # the driver's own exit status
    assert "driver started" in output  # its output goes where the entrypoint's goes (Ray's job log)
    assert (tmp_path / "driver.got").read_text() == "SIGINT"  # once: the keeper did not pass it on twice
    assert (tmp_path / "service.alive").read_text() == "True"
    assert not (tmp_path / "service.got").exists(), "the service under the driver was signalled"


def test_the_driver_and_its_processes_die_with_a_killed_entrypoint(tmp_path):
    with _running(tmp_path) as (entrypoint, driver_pid, service_pid):
        _signal_like_ray(entrypoint, signal.SIGKILL)  # Ray's last resort after the grace period
        entrypoint.communicate(timeout=30)
        assert _gone(driver_pid), "the driver outlived its killed entrypoint"
        assert _gone(service_pid), "the driver's service outlived its killed entrypoint"


def test_a_killed_keeper_takes_the_driver_with_it_and_the_entrypoint_fails(tmp_path):
    with _running(tmp_path) as (entrypoint, driver_pid, service_pid):
        os.kill(psutil.Process(driver_pid).ppid(), signal.SIGKILL)  # the keeper, the driver's parent
        output, _ = entrypoint.communicate(timeout=30)
        assert entrypoint.returncode == 1 and "the keeper process" in output and "died" in output, output
        assert _gone(driver_pid), "the driver outlived its keeper"
        assert _gone(service_pid), "the driver's service outlived its keeper"


@pytest.mark.parametrize(
    ("driver", "status"),
    [("import sys; sys.exit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137)],
)
def test_the_entrypoint_exits_with_the_drivers_status(tmp_path, driver, status):
    entrypoint = _start(tmp_path, driver)
    output, _ = entrypoint.communicate(timeout=30)  # to the keeper's end: it holds the output pipe too
    assert entrypoint.returncode == status, output
    assert "entrypoint died" not in output  # the entrypoint's normal exit is no death of it


def test_exit_status_is_what_a_shell_reports():
    assert exit_status(0) == 0 and exit_status(2) == 2
    assert exit_status(-signal.SIGKILL) == 137 and exit_status(-signal.SIGINT) == 130


def test_no_command_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "cluster.remote.job_entrypoint"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert result.returncode == 2 and "COMMAND" in result.stderr
