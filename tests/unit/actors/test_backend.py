"""Both generator backends answer the driver's calls (`actors/backend.py`) with the protocol's parameters."""

import inspect

import pytest

from actors.backend import GENERATOR_CALLS, GeneratorBackend
from actors.generator import Generator
from actors.streaming import StreamingGenerator


def _parameters(function) -> list[tuple[str, object]]:
    """The call's parameters, without the `_ray_trace_ctx` that Ray adds in place to the methods of every class
    it makes an actor of (an earlier test in the same process may have)."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values() if p.name != "_ray_trace_ctx"]


def test_the_protocol_names_every_call_the_driver_makes():
    calls = {
        name for name, value in vars(GeneratorBackend).items() if inspect.isfunction(value) and not name.startswith("_")
    }
    assert calls == set(GENERATOR_CALLS)


@pytest.mark.parametrize("backend", [Generator, StreamingGenerator])
@pytest.mark.parametrize("call", GENERATOR_CALLS)
def test_each_backend_takes_each_call_with_the_protocols_parameters(backend, call):
    assert hasattr(backend, call), f"{backend.__name__} lacks {call}"
    assert _parameters(getattr(backend, call)) == _parameters(getattr(GeneratorBackend, call))
