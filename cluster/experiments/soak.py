"""Soak: a long run with a generator killed every so often; it must finish with a complete ledger.

    stableasync soak deploy/jobs/demo.yaml --steps 6000 --kill-every-s 120

The job runs for `--steps` learner steps (choose them for the duration you want: the demo takes about
0.25 s a step on 2 CPU cores, plus ~15 s per generator restart) with unlimited generator restarts,
while a thread SIGKILLs a random generator's process every `--kill-every-s` seconds (jittered
+-25%). At the end the ledger is audited: every issued prompt group must have been trained or
dropped (with a reason) exactly once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from actors.buffer import audit_ledger
from cluster.job import Job


def _killer(
    job: Job, run_name: str, every_s: float, stop: threading.Event, kills: list[tuple[float, int, int]]
) -> None:
    import ray

    rng, started = random.Random(0), time.monotonic()
    while not stop.wait(every_s * rng.uniform(0.75, 1.25)):
        index = rng.randrange(job.generator.num_generators)
        try:
            # Any: Ray's ActorHandle types no method's `.remote`
            generator: Any = ray.get_actor(f"{run_name}-generator-{index}", namespace=job.cluster.namespace)
            pid = ray.get(generator.process_id.remote(), timeout=60)
            os.kill(pid, signal.SIGKILL)
        except Exception as error:
            print(f"soak: no kill at {time.monotonic() - started:.0f} s ({type(error).__name__})", flush=True)
            continue
        kills.append((time.monotonic() - started, index, pid))
        print(f"soak: killed generator {index} (pid {pid}) at {time.monotonic() - started:.0f} s", flush=True)


def soak(job: Job, steps: int, kill_every_s: float) -> int:
    """Run `job` for `steps` steps under generator kills; print the audit; 0 when nothing was lost."""
    from cluster.run.driver import run_job

    run_name = f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    job = job.model_copy(
        update={
            "learner": job.learner.model_copy(update={"steps": steps}),
            "generator": job.generator.model_copy(update={"max_restarts": 10**6}),
            "logging": job.logging.model_copy(update={"run_name": run_name, "progress_bar": False}),
        }
    )
    stop = threading.Event()
    kills: list[tuple[float, int, int]] = []  # (seconds since the start, generator index, pid)
    killer = threading.Thread(target=_killer, args=(job, run_name, kill_every_s, stop, kills), daemon=True)
    started = time.monotonic()
    killer.start()
    try:
        result = run_job(job)
    finally:
        stop.set()
        killer.join(timeout=120)
    rows = [json.loads(line) for line in (Path(result.run_dir) / "ledger.jsonl").read_text().splitlines()]
    problems = audit_ledger(rows)
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    print(
        f"soak: {steps} steps in {(time.monotonic() - started) / 60:.1f} min, {len(kills)} generator kills, "
        f"{summary['generator_restarts']} restarts seen, {sum(r['event'] == 'reissued' for r in rows)} groups "
        f"reissued; ledger {summary['ledger']}; audit: {'complete' if not problems else problems[:10]}"
    )
    print(f"soak: run directory {result.run_dir}")
    return 0 if not problems and (summary["generator_restarts"] > 0 or not kills) else 1
