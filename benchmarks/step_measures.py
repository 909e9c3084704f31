"""How the learner benchmarks measure a step: wall time with the GPU synchronised, peak memory above what the
process held (the CUDA allocator's, or the resident set's high-water mark on the CPU), a profile (GPU busy share,
top kernels, operator calls), and a step's FLOPs and backward passes through the model."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

import torch

PROFILE_TOP_KERNELS = 10
PROFILE_NAME_CHARS = 100  # kernel names are whole C++ template signatures


def on_cuda() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name(0) if on_cuda() else "cpu"


def default_dtype() -> str:
    """bfloat16 where a GPU runs it at full speed; float32 on the CPU stack, as the CPU jobs train."""
    return "bfloat16" if on_cuda() else "float32"


def _synchronize() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def timed_seconds(step: Callable[[], Any]) -> float:
    """Wall time of `step()` with the GPU's queued work before it finished first and its own work included."""
    _synchronize()
    start = time.perf_counter()
    step()
    _synchronize()
    return time.perf_counter() - start


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_bytes() -> int:
    """What the process holds between steps: CUDA memory allocated, or the resident set after returning freed
    memory to the system."""
    if on_cuda():
        _synchronize()
        return torch.cuda.memory_allocated()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss_bytes()


def _peak_rss_bytes() -> int:
    """The kernel's high-water mark of the resident set (VmHWM, Linux), exact where sampling misses peaks."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def peak_growth(step: Callable[[], Any]) -> int:
    """Peak memory while `step()` runs above what the process held when it began: the CUDA allocator's peak on
    a GPU; on the CPU the kernel's resident-set high-water mark, reset (Linux's clear_refs 5) after
    malloc_trim."""
    if on_cuda():
        base = held_bytes()
        torch.cuda.reset_peak_memory_stats()
        step()
        _synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = held_bytes()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    step()
    return _peak_rss_bytes() - base


def follow_live_memory() -> None:
    """Pin glibc's mmap threshold so the resident set follows live tensors, as a GPU's allocated bytes do (left
    to slide, later frees stay on the heap: one step's peak moved by a fifth between runs). A page fault per
    large allocation, so benchmarks that time a step leave it off."""
    if not ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024):  # -3: M_MMAP_THRESHOLD in malloc.h
        raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD, 128 KiB)")


def covered_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans: the time at least one of them ran (kernels may overlap)."""
    total = 0.0
    reach = float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def top_by_time(timed: list[tuple[str, float]], count: int) -> list[tuple[str, float, int]]:
    """(name, total microseconds, calls) of the `count` names with the most time, most first."""
    totals: dict[str, list[float]] = {}
    for name, us in timed:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [(name, us, int(calls)) for name, (us, calls) in ranked]


def profile_step(step: Callable[[], Any]) -> dict[str, Any]:
    """One `step()` under torch.profiler: its wall time, on a GPU the time some kernel was running and the top
    kernels by device time; on the CPU the top operators by self CPU time (busy_s None). `host_top`, the top
    operators by self CPU time, shows where a GPU step that leaves the card idle spends its host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda() else [])]
    with profile(activities=activities) as profiler:
        wall_s = timed_seconds(step)
    events = profiler.events()
    host_timed = [
        (event.name, event.self_cpu_time_total)
        for event in events
        if event.device_type == DeviceType.CPU and not event.is_async
    ]
    host_top = top_by_time(host_timed, PROFILE_TOP_KERNELS)
    # what a step asks of the device one call at a time: on a GPU whose kernels run for less time than the host
    # takes to launch them, the step's time follows this count
    operators = sum(1 for event in events if _is_outer_operator(event))
    if on_cuda():
        kernels = [event for event in events if event.device_type == DeviceType.CUDA]
        busy_s: float | None = covered_us([(k.time_range.start, k.time_range.end) for k in kernels]) / 1e6
        timed = [(kernel.name, kernel.time_range.elapsed_us()) for kernel in kernels]
    else:
        busy_s, timed = None, host_timed
    return {
        "wall_s": wall_s,
        "busy_s": busy_s,
        "top": top_by_time(timed, PROFILE_TOP_KERNELS),
        "host_top": host_top,
        "operators": operators,
    }


def _is_outer_operator(event: Any) -> bool:
    """An aten operator called from outside any other (its own calls inside are not counted again)."""
    parent = event.cpu_parent
    return event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::"))


def print_profile(label: str, profile: dict[str, Any]) -> None:
    wall_s, busy_s = profile["wall_s"], profile["busy_s"]
    if busy_s is None:
        print(
            f"  profile of {label}: {wall_s:.3f} s step under the profiler, {profile['operators']} operator calls;"
            " top operators by self CPU time:"
        )
    else:
        print(
            f"  profile of {label}: {wall_s:.3f} s step under the profiler, a GPU kernel running "
            f"{busy_s:.3f} s of it ({busy_s / wall_s:.0%}), {profile['operators']} operator calls; top kernels by"
            " device time:"
        )
    for name, us, calls in profile["top"]:
        print(f"    {us / 1e3:>9.1f} ms {us / 1e6 / wall_s:>6.1%} {calls:>6}x  {name[:PROFILE_NAME_CHARS]}")
    if busy_s is not None:
        print("  top host operators by self CPU time:")
        for name, us, calls in profile["host_top"]:
            print(f"    {us / 1e3:>9.1f} ms {us / 1e6 / wall_s:>6.1%} {calls:>6}x  {name[:PROFILE_NAME_CHARS]}")


def counted_step(model: torch.nn.Module, step: Callable[[], Any]) -> tuple[int, int]:
    """One `step()`'s FLOPs (`torch.utils.flop_counter.FlopCounterMode`: matmuls, attention) and how many
    backward passes went through the whole model: each one reaches the input embedding's output once."""
    from torch.utils.flop_counter import FlopCounterMode

    embedding = model.get_input_embeddings()
    backwards = 0

    def count(gradient: torch.Tensor) -> None:
        nonlocal backwards
        backwards += 1

    def hook_output(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(count)

    handle = embedding.register_forward_hook(hook_output)
    try:
        with FlopCounterMode(display=False) as counter:
            step()
    finally:
        handle.remove()
    return int(counter.get_total_flops()), backwards
