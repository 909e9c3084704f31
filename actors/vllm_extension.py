"""vLLM worker extension: load new weights in place, no engine restart.

vLLM imports this class into its worker by dotted path (`worker_extension_cls`), so it must stay
importable without the rest of the project.
"""

from __future__ import annotations

from typing import Any


class WeightUpdateExtension:
    """Methods mixed into the vLLM worker; called through `LLM.collective_rpc`."""

    def update_weights_from_state_dict(self, state_dict: Any) -> int:
        """Reload from HF-checkpoint-named tensors (or safetensors bytes across a process boundary)."""
        if isinstance(state_dict, (bytes, bytearray, memoryview)):
            from safetensors.torch import load

            state_dict = load(bytes(state_dict))
        self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(state_dict)
