"""Run checkpoints on disk: atomic writes, pruning, and choosing one to resume from.

`runs/<run>/checkpoints/step-NNNNNN/` holds `learner/` (every rank's DeepSpeed state) and
`driver.json` (the driver's state). A checkpoint is written as `.step-NNNNNN.tmp` and renamed when
complete, so a crash mid-write leaves no folder that looks usable. Resuming takes the newest one
that reads back, and falls back to older ones (loudly) when the newest is damaged.

`runs/<run>/model/` is the policy a finished run ends with, as a Hugging Face model folder.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from algorithms.errors import StableAsyncError
from cluster.run.state import DriverState

log = logging.getLogger("stableasync")

CHECKPOINTS = "checkpoints"
MODEL = "model"
REFERENCE = "reference"  # the KL reference as RL starts (algorithm.kl.reference rl_start after a warm-up)
LEARNER = "learner"
TAG = "state"


class CheckpointFailed(StableAsyncError, RuntimeError):
    """A checkpoint that could not be written (a full disk, a quota, storage gone); nothing of it is left."""


class NoCheckpointRestored(StableAsyncError, RuntimeError):
    """None of a run's checkpoints loaded into the learner; the message lists each one's error."""


def write_checkpoint(
    run_dir: Path, version: int, keep: int, save_learners: Callable[[str, str], None], driver_state: DriverState
) -> Path:
    """Write step `version` atomically (learner ranks first, then the driver), keep the newest `keep`."""
    root = run_dir / CHECKPOINTS
    name = f"step-{version:06d}"
    partial, final = root / f".{name}.tmp", root / name
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        save_learners(str(partial / LEARNER), TAG)  # a learner's OSError comes back as one (Ray's RayTaskError)
        (partial / "driver.json").write_text(json.dumps(driver_state.to_json()))
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)  # a full disk gets its space back
        raise CheckpointFailed(
            f"the checkpoint of step {version} could not be written to {root}: {type(error).__name__}: {error}"
        ) from error
    if final.exists():  # a damaged one from before a resume: set aside, replace, then delete
        stale = root / f".{name}.replaced"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


class ModelSaveFailed(StableAsyncError, RuntimeError):
    """A model folder that could not be written; nothing of it is left, and an older one stays as it was."""


def write_model(folder: Path, save_model: Callable[[str], None]) -> Path:
    """A Hugging Face model folder (`RUN_DIR/model`, the trained policy, or an exported checkpoint). Written as
    `.NAME.tmp` beside it and renamed when complete, so the folder is never half-written."""
    partial = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_model(str(partial))  # a learner's OSError comes back as one (Ray's RayTaskError)
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise ModelSaveFailed(f"the model could not be written to {folder}: {type(error).__name__}: {error}") from error
    _modes_as_config(partial)
    if folder.exists():  # a resumed run that finished again replaces what it wrote before
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder


def _modes_as_config(folder: Path) -> None:
    """Every file of a model folder readable as its config.json is (safetensors' weights come out 0600, by a
    temporary file, where the umask gives the others 0644: another user could read the config, not the model)."""
    config = folder / "config.json"
    if not config.is_file():
        return
    mode = config.stat().st_mode & 0o777
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def readable_checkpoints(run_dir: Path) -> list[tuple[Path, DriverState]]:
    """Complete checkpoints whose driver state reads back, newest first; damaged ones are skipped loudly."""
    usable = []
    for path in sorted((p for p in (run_dir / CHECKPOINTS).glob("step-*") if p.is_dir()), reverse=True):
        try:
            state = DriverState.from_json(json.loads((path / "driver.json").read_text()))
        except (OSError, ValueError) as error:
            log.warning("checkpoint %s is unusable (%s); trying an older one", path, error)
            continue
        usable.append((path, state))
    return usable


def restore_learners(
    load: Callable[[str, str], int],
    candidates: list[tuple[Path, DriverState]],
    fatal: tuple[type[BaseException], ...] = (),
) -> tuple[Path, DriverState]:
    """Load the newest candidate the learner ranks accept; an older one when the newest fails.

    An error of a `fatal` type (a rank died, or the ranks' collectives fell out of step) leaves ranks that
    cannot load anything more, so it is raised rather than taken as that checkpoint's fault.
    """
    errors = []
    for path, state in candidates:
        try:
            load(str(path / LEARNER), TAG)
            return path, state
        except fatal:
            raise
        except Exception as error:
            log.warning(
                "learner state in %s did not load (%s); trying an older checkpoint",
                path,
                str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
            )
            errors.append(f"{path.name}: {type(error).__name__}")
    raise NoCheckpointRestored(f"no checkpoint could be restored ({'; '.join(errors) or 'none found'})")
