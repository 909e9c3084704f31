"""Fused CPU scans (algorithms/csrc/token_scans.cpp) for M2PO's trust region and BAPO's movers.

Eager PyTorch pays a pass over the whole [B, T] batch per elementwise op, and these selections take
several; the C++ loops make them in one pass per row, which is what brings M2PO and BAPO near the
cost of the other stabilizers on CPU (`python -m benchmarks.stabilizers`). They select the same
tokens as the torch path beside each call, which stays the reference, serves CUDA tensors, and
serves any process that cannot build the op.

The op is built by torch.utils.cpp_extension, as DeepSpeed builds its CPU ops here, into
TORCH_EXTENSIONS_DIR; ./install.sh builds it once, and a process that finds it built only loads it.
STABLEASYNC_NATIVE=0 turns it off (the torch path then runs everywhere).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from algorithms.errors import StableAsyncError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "token_scans.cpp"
# No -march: one build may serve every machine that shares the cache. -fno-trapping-math lets the
# compiler vectorise the selects (it changes no result); -ffp-contract=off keeps a * b + c unfused,
# so products round as the torch path rounds them.
CFLAGS = ["-O3", "-fno-trapping-math", "-ffp-contract=off"]

_turned_off = 0  # how many `turned_off()` blocks are open


def extensions_dir() -> Path:
    """Where built ops live: TORCH_EXTENSIONS_DIR, which install.sh and the Ray workers share, or its
    default there."""
    default = Path.home() / ".cache" / "stableasync" / "torch_extensions"
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", default))


@functools.cache
def module() -> ModuleType | None:
    """The built op, or None when it is turned off or cannot be built (the reason is logged once)."""
    if os.environ.get("STABLEASYNC_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        build_directory = extensions_dir() / f"stableasync_token_scans-torch{torch.__version__}"
        build_directory.mkdir(parents=True, exist_ok=True)
        return load("stableasync_token_scans", [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(build_directory))
    except Exception as error:  # no compiler or headers: the torch path selects the same tokens
        log.warning("stableasync: the fused CPU scans could not be built (%s); using the torch path", error)
        return None


@contextlib.contextmanager
def turned_off() -> Iterator[None]:
    """Inside, every stabilizer takes the torch path: to compare the two paths in one process."""
    global _turned_off
    _turned_off += 1
    try:
        yield
    finally:
        _turned_off -= 1


def usable(token_tensors: tuple[Tensor, ...], advantages: Tensor) -> bool:
    """Whether the fused scans take these: fp32 [B, T] CPU tensors, contiguous, with one advantage per
    row (per-token advantages take the torch path), and the op available."""
    shape = token_tensors[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in token_tensors) or advantages.shape != shape[:1]:
        return False  # the C++ trusts these shapes; mismatches get the torch path's error
    for tensor in (*token_tensors, advantages):
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return False
    return not _turned_off and module() is not None


class NativeUnavailable(StableAsyncError, RuntimeError):
    """A fused scan was called where `usable` says no (a bug in the caller, not a user error)."""


def _built() -> ModuleType:
    built = module()
    if built is None:
        raise NativeUnavailable("the fused CPU scans are not built here: callers check usable() first")
    return built


def m2po_region_scan(log_ratio: Tensor, advantages: Tensor, threshold: float) -> tuple[int, float, Tensor, Tensor]:
    """M2PO's trust region in one pass: its token count, the fp64 sum of its (log r)^2, and the values
    above the fp32 `threshold` with their flat indices (flat order). `log_ratio` must be 0 on padding."""
    return _built().m2po_region_scan(log_ratio.detach(), advantages.detach(), threshold)


def bapo_movers(
    log_ratio: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    interval: tuple[float, float, float],
    log_highs: Tensor,
    log_lows: Tensor,
    dual_clip_below_lows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float, float]:
    """BAPO's movers in one pass; see `bapo_movers` in token_scans.cpp. `interval` is (log low,
    log high, log c) of the narrowest clip, rounded to fp32 as the torch path's comparisons round them."""
    log_low, log_high, log_c = interval
    return _built().bapo_movers(
        log_ratio.detach(),
        ratio.detach(),
        advantages.detach(),
        log_low,
        log_high,
        log_c,
        log_highs,
        log_lows,
        dual_clip_below_lows,
    )
