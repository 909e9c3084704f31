"""What a generator backend is to the driver: the calls it makes of every generator actor, whichever engine
runs underneath (`Generator`, vLLM's LLM with calls run in order; `StreamingGenerator`, vLLM's AsyncLLM with
calls run at once). A third backend implements these, with these parameters; a method may be a coroutine
(an async Ray actor awaits it), and the caller always reaches it through Ray. `tests/unit/actors/test_backend.py`
holds both backends to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from actors.generator import GeneratedGroup, GenerationRequest, GeneratorSpec
    from learner.weight_sync import PackedWeights


class GeneratorBackend(Protocol):
    """The driver's view of one generator. Results travel with their timings (`ReportsTimings`), and every
    response records the policy versions that sampled it (`completion_record`), so a backend that shares
    those helpers shares the ledger's and the staleness metrics' meaning."""

    spec: GeneratorSpec
    index: int  # the generator's place in the pool: engine seeds and device placement derive from it
    version: int  # the policy version of its weights
    incarnation: str  # new on every (re)start: the driver tells a restarted actor's groups apart

    def generate(
        self, requests: list[GenerationRequest], samples: int | None = None, temperature: float | None = None
    ) -> list[GeneratedGroup] | Any:
        """Each request's group of responses with processed log-probs; `samples` and `temperature` override the
        spec's for one call (evaluation). Groups carry the call's timings."""

    def update_weights(self, weights: PackedWeights, version: int) -> float | Any:
        """Load a published version from the object store (or, with LoRA, its adapter); seconds taken."""

    def join_weight_transfer(self, host: str, port: int, rank_offset: int, world_size: int) -> None | Any:
        """Join learner rank 0's collective weight group (nccl or stableasync_gloo) as ranks from `rank_offset`."""

    def receive_weights(self, update_info: dict[str, Any], version: int) -> float | Any:
        """Receive the broadcast learner rank 0 sends at the same time; seconds taken."""

    def process_id(self) -> int | Any:
        """Its OS process, which operators and fault tests kill to check recovery."""


GENERATOR_CALLS = ("generate", "update_weights", "join_weight_transfer", "receive_weights", "process_id")
