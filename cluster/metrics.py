"""One metric sink: JSONL in the run directory always, W&B when it works, a progress line for people.

Metric logging is never fatal: a W&B failure is logged once and training goes on with the JSONL.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("stableasync")

PROGRESS_KEYS = (
    ("reward", "rollout/reward_mean", "{:.3f}"),
    ("ess", "stability/ess_ratio", "{:.2f}"),
    ("lag", "async/lag_mean", "{:.1f}"),
    ("gen tok/s", "perf/gen_tokens_per_s", "{:.0f}"),
)


class MetricSink:
    """Writes each step's metrics to `metrics.jsonl`, W&B and a one-line progress display."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], wandb_mode: str = "offline",
                 wandb_project: str = "stableasync", wandb_entity: str | None = None, progress_bar: bool = True,
                 total_steps: int | None = None) -> None:
        self.run_dir = run_dir
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        with (run_dir / "metrics.jsonl").open() as rows:
            self.lines = sum(1 for _ in rows)  # rows so far (a resumed run has some)
        self._progress = progress_bar
        self._total = total_steps
        self._started = time.monotonic()
        self._wandb = None
        if wandb_mode != "disabled":
            self._wandb = self._init_wandb(run_name, config, wandb_mode, wandb_project, wandb_entity)

    def _init_wandb(self, name: str, config: dict[str, Any], mode: str, project: str, entity: str | None) -> Any:
        try:
            import wandb

            run = wandb.init(project=project, entity=entity, name=name, mode=mode, dir=str(self.run_dir),
                             config=config, reinit="finish_previous")
            for prefix in ("rollout", "stability", "optim", "async", "perf", "time", "sft", "eval"):
                run.define_metric(f"{prefix}/*", step_metric="train/step")
            return run
        except Exception as error:  # noqa: BLE001 - W&B must never stop training
            log.warning("W&B disabled for this run (%s: %s); metrics stay in %s", type(error).__name__, error,
                        self.run_dir / "metrics.jsonl")
            return None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step. Lists (histograms) go to JSONL as lists and to W&B as histograms."""
        row = {"train/step": step, "time/wall_s": round(time.monotonic() - self._started, 3), **metrics}
        self._jsonl.write(json.dumps(_jsonable(row)) + "\n")
        self._jsonl.flush()
        self.lines += 1
        if self._wandb is not None:
            try:
                self._wandb.log(_for_wandb(row))
            except Exception as error:  # noqa: BLE001
                log.warning("W&B logging failed (%s); continuing with JSONL only", error)
                self._wandb = None
        if self._progress:
            self._print_progress(step, row)

    def alert(self, title: str, text: str) -> None:
        """A log line always; a W&B alert when W&B is up."""
        log.warning("ALERT %s: %s", title, text)
        if self._wandb is not None:
            try:
                self._wandb.alert(title=title, text=text)
            except Exception:  # noqa: BLE001 - offline runs cannot send alerts
                pass

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as error:  # noqa: BLE001
                log.warning("W&B finish failed: %s", error)

    def _print_progress(self, step: int, row: dict[str, Any]) -> None:
        parts = [f"step {step}" + (f"/{self._total}" if self._total else "")]
        for label, key, fmt in PROGRESS_KEYS:
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                parts.append(f"{label} {fmt.format(value)}")
        parts.append(f"{row['time/wall_s']:.0f}s")
        print(" | ".join(parts), file=sys.stderr, flush=True)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no NaN; keep the fact visible
        out[key] = value
    return out


def _for_wandb(row: dict[str, Any]) -> dict[str, Any]:
    import wandb

    out = {}
    for key, value in row.items():
        if isinstance(value, list):
            counts = [float(v) for v in value]
            out[key] = wandb.Histogram(np_histogram=(counts, list(range(len(counts) + 1))))
        else:
            out[key] = value
    return out
