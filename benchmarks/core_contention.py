"""How much one busy core slows another on this machine, measured side by side in one run.

    python -m benchmarks.core_contention [--repeats 3]

The same single-thread torch loop runs alone on one core, then on two cores at once (one process
each, pinned); the ratio is the slowdown each process sees when both cores are busy. Two loops: a
compute-bound one (a 256 x 256 matmul, cache-resident) and a memory-bound one (a pass over 16 MB,
well past a core's L2). An asynchronous run keeps the generator and the learner busy at once, so its
phases run slower than in the synchronous run by about the share of their time that is memory-bound:
the async speedup benchmark's ideal, taken from the synchronous phases, cannot account for that.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections.abc import Callable

import torch

Step = Callable[[], object]


def _matmul() -> Step:
    square = torch.randn(256, 256)
    return lambda: square @ square


def _memory_pass() -> Step:
    large = torch.randn(4_000_000)
    return lambda: large.mul(1.0001).sum()


# label -> (builds the timed step, untimed; iterations)
LOOPS: dict[str, tuple[Callable[[], Step], int]] = {
    "compute (matmul 256^2)": (_matmul, 3000),
    "memory (16 MB pass)": (_memory_pass, 150),
}


def _timed_loop(core: int, build: Callable[[], Step], iterations: int, results: mp.Queue) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    step = build()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    results.put(time.perf_counter() - start)


def _run(cores: list[int], build: Callable[[], Step], iterations: int) -> float:
    """Seconds of the slowest of the processes started together, one per core. Forked, so call it
    before this process starts threads (Ray, a torch thread pool); the children use one thread."""
    context = mp.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_timed_loop, args=(core, build, iterations, results)) for core in cores]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return max(results.get() for _ in processes)


def slowdown_with_both_cores_busy(repeats: int = 3) -> dict[str, tuple[float, float]] | None:
    """{label: (seconds alone, seconds with both cores busy)}, fastest of `repeats` interleaved rounds;
    None when this process may use fewer than two cores."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        return None
    seconds: dict[str, tuple[float, float]] = {}
    for label, (build, iterations) in LOOPS.items():
        alone, both = [], []
        for _ in range(repeats):
            alone.append(_run(cores[:1], build, iterations))
            both.append(_run(cores, build, iterations))
        seconds[label] = (min(alone), min(both))
    return seconds


def report(seconds: dict[str, tuple[float, float]] | None) -> str:
    """One line per loop: its seconds alone, with both cores busy, and the slowdown."""
    if seconds is None:
        return "core contention: not measured (fewer than two usable cores)"
    return "\n".join(
        f"{loop:<24} alone {alone:6.2f} s   both cores busy {both:6.2f} s   slowdown x{both / alone:.2f}"
        for loop, (alone, both) in seconds.items()
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    print(report(slowdown_with_both_cores_busy(args.repeats)))


if __name__ == "__main__":
    main()
