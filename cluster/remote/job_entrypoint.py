"""The entrypoint of a submitted job: Ray's stop signal reaches the driver alone, not the processes it started.

    python -m cluster.remote.job_entrypoint COMMAND [ARG ...]

`ray job stop` (what `stableasync stop` calls) sends its stop signal to the entrypoint process and to
every process below it by parent pid. Below the driver that includes the W&B service (wandb-core),
which on SIGINT or SIGTERM shuts down at once without writing what it holds, so a stopped job's W&B
run file was cut short even though the driver itself stopped cleanly at a step boundary.

So this entrypoint starts COMMAND outside its own process tree, under a small keeper process in a new
session (a double fork), and passes each SIGINT or SIGTERM it gets on to COMMAND only. COMMAND, the
driver, then stops as after a Ctrl-C and closes its W&B run itself. The entrypoint exits with the
driver's status (128 + N for a driver killed by signal N). It must not outlive its driver, nor the
driver its job: when the entrypoint dies (Ray's SIGKILL after the grace period, or a dead supervisor
killing its process group), the keeper sees its pipe close and kills the driver's process group; should
the keeper die, the entrypoint kills that group (and the kernel the driver: PR_SET_PDEATHSIG) and exits 1.

Standard library only, and no thread before the fork: forking a process that runs threads is unsafe.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

FORWARDED = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_status(returncode: int) -> int:
    """A shell's exit status for a subprocess return code: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Forwarder:
    """Passes SIGINT and SIGTERM on through `send`, holding those that arrive before `send` is set."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.send: Callable[[int], None] | None = None
        for number in FORWARDED:
            signal.signal(number, self._handle)

    def _handle(self, number: int, frame: object) -> None:
        if self.send is None:
            self.pending.append(number)
        else:
            self.send(number)

    def to(self, send: Callable[[int], None]) -> None:
        self.send = send
        for number in self.pending:
            send(number)


def _die_with_parent() -> None:
    """Run in the driver before exec: SIGKILL it when its parent, the keeper, dies (Linux prctl)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _keep(command: Sequence[str], forwarder: _Forwarder, status_w: int, alive_r: int) -> None:
    """The keeper, in its own session: run the driver, forward signals to it, report its exit status."""
    # its own group, to kill it whole; and killed by the kernel should the keeper die first
    driver = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_die_with_parent)
    forwarder.to(driver.send_signal)
    os.write(status_w, f"driver {driver.pid}\n".encode())

    finished = threading.Event()

    def kill_when_the_entrypoint_dies() -> None:
        os.read(alive_r, 1)  # nothing is ever written: this returns when the entrypoint's end closes
        if finished.is_set():  # it closes after reading the exit status: the driver is already done
            return
        print(
            f"job entrypoint died: killing the driver (pid {driver.pid}) and its process group",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)

    threading.Thread(target=kill_when_the_entrypoint_dies, daemon=True).start()
    status = exit_status(driver.wait())
    finished.set()
    os.write(status_w, f"exit {status}\n".encode())


def _start_keeper(command: Sequence[str]) -> tuple[int, int, int]:
    """Double fork the keeper into a new session, so that it is no descendant of this process.

    Returns the keeper's pid, the read end of its status pipe and the write end of the pipe whose
    closing tells it this process is gone (kept open for this process's lifetime).
    """
    status_r, status_w = os.pipe()
    alive_r, alive_w = os.pipe()
    middle = os.fork()
    if middle == 0:  # pragma: no cover - runs in the forked children, checked by the tests' processes
        try:
            os.setsid()
            if os.fork() == 0:
                os.close(status_r)
                os.close(alive_w)
                forwarder = _Forwarder()  # before the entrypoint knows where to send signals
                os.write(status_w, f"keeper {os.getpid()}\n".encode())
                _keep(command, forwarder, status_w, alive_r)
        except BaseException as error:
            print(f"job entrypoint: the keeper failed: {error!r}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)
    os.close(status_w)
    os.close(alive_r)
    os.waitpid(middle, 0)
    return _read_pid(status_r), status_r, alive_w


def _read_pid(status_r: int) -> int:
    line = _read_line(status_r)
    if not line.startswith("keeper "):
        raise RuntimeError(f"the job's keeper process did not start (it said {line!r})")
    return int(line.split()[1])


def _read_line(fd: int) -> str:
    """One line from a pipe, byte by byte (a buffered reader could swallow the next line); '' at its end."""
    data = b""
    while not data.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        data += byte
    return data.decode().strip()


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    forwarder = _Forwarder()
    sys.stdout.flush()
    sys.stderr.flush()
    keeper_pid, status_r, _alive_w = _start_keeper(command)
    forwarder.to(lambda number: os.kill(keeper_pid, number))
    driver_pid = None
    while (line := _read_line(status_r)).startswith("driver "):
        driver_pid = int(line.split()[1])
    if line.startswith("exit "):
        return int(line.split()[1])
    print(
        f"job entrypoint: the keeper process (pid {keeper_pid}) died; killing the driver's process group",
        file=sys.stderr,
    )
    if driver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver_pid, signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
