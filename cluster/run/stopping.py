"""Ctrl-C and SIGTERM stop a run at a step boundary, with a checkpoint, instead of killing it mid-step.

Ctrl-C, `kill`, a preempted node's SIGTERM: a run that simply died would lose every step since its last
periodic checkpoint and cut its ledger and W&B run short. Under `stop_on_signals` the first signal
only asks: the training loop lets the learner step in flight finish, writes a checkpoint (whatever
`checkpoint.every_steps` says), closes the ledger and the metric sink and raises `JobStopped`, whose
message says how to continue (`stableasync train --resume RUN_DIR`). A second signal stops at once.

A terminal's Ctrl-C reaches every process of its foreground group: the local Ray cluster a driver
starts, whose services block SIGINT, so the driver still has it to checkpoint with; and the verifier
workers, which `tasks.scoring` starts ignoring it (`children_ignore_sigint`), so a scoring call in
progress ends without failed samples or replaced workers.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from algorithms.errors import StableAsyncError

log = logging.getLogger("stableasync")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set by the first stop signal; the training loop reads it on every turn."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._take_signals: Callable[[], None] = lambda: None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, signal_name: str) -> None:
        self.signal_name = signal_name

    def take_signals(self) -> None:
        """Install the stop handlers again, over any set since: ray.init makes a driver's SIGTERM sys.exit."""
        self._take_signals()


class JobStopped(StableAsyncError, RuntimeError):
    """A run that stopped when asked, at a checkpoint it can continue from."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path, run_dir: Path) -> None:
        super().__init__(
            f"stopped by {signal_name} after step {step}, with a checkpoint at {checkpoint}; "
            f"to continue: stableasync train --resume {run_dir}"
        )
        self.exit_code = 128 + signal.Signals[signal_name].value  # what the shell reports for a signal


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Turn the first SIGINT or SIGTERM into a stop request; the second raises KeyboardInterrupt.

    Signals the process ignores (a background job's SIGINT) stay ignored; blocked ones are unblocked (a
    process a Ray worker starts, such as a submitted job's driver, inherits SIGINT blocked). Handlers can
    only be set from the main thread; elsewhere the request is never set and signals act as before.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, previous)

    def restore() -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)

    def handle(number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if stop.requested:
            restore()
            raise KeyboardInterrupt(f"{name} again: stopping at once")
        stop.request(name)
        log.warning(
            "%s: stopping at the next step boundary (the learner step in flight, or the end of start-up), "
            "with a checkpoint (%s again stops at once)",
            name,
            name,
        )

    def take_signals() -> None:
        if not stop.requested:  # after a first signal the next one must stop at once, as the caller's would
            for number in previous:
                signal.signal(number, handle)

    stop._take_signals = take_signals
    stop.take_signals()
    try:
        yield stop
    finally:
        restore()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
