"""vLLM's per-reload log lines, kept off the console: the generators and the engine's worker extension both quiet
them, so this lives apart from either (the extension runs inside vLLM's worker process)."""

from __future__ import annotations

import logging

# vLLM logs from these on every in-place reload, i.e. once per step: at INFO the reload, its timing (our
# perf/weight_load_s carries it) and the prefix-cache reset, and at WARNING that RotaryEmbedding "failed
# to load weights" (its cos/sin cache is a buffer, not a weight; vLLM puts it back). Their other
# warnings and errors still pass.
PER_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.v1.core.block_pool",
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.v1.core.sched.scheduler",
)  # a streaming engine's pause and resume around each load


def _is_not_per_reload_noise(record: logging.LogRecord) -> bool:
    if record.levelno < logging.WARNING:
        return False
    return not (record.levelno == logging.WARNING and record.getMessage() == "RotaryEmbedding: Failed to load weights")


def quieted_loggers() -> list[str]:
    """The per-reload loggers that drop their noise in this process."""
    return [name for name in PER_RELOAD_LOGGERS if _is_not_per_reload_noise in logging.getLogger(name).filters]


def quiet_per_reload_logs() -> None:
    """Keep vLLM's per-reload lines off the console (and off Ray's log forwarding to the driver)."""
    for name in PER_RELOAD_LOGGERS:
        logger = logging.getLogger(name)
        if _is_not_per_reload_noise not in logger.filters:
            logger.addFilter(_is_not_per_reload_noise)
