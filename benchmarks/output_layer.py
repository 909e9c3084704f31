"""The output layer and log-softmax, fused chunk by chunk against whole logits: time and peak memory.

    python -m benchmarks.output_layer [--model-config qwen2.5-1.5b] [--tokens 4096] [--rounds 3]
        [--dtype bfloat16]

One forward and backward of sum_t log pi(y_t) (with the entropy) from random last hidden states
[tokens, hidden] through the named architecture's output layer (random weights; vocabulary and hidden size
as published), both ways in this one process: `whole` forms the [tokens, vocabulary] logits and the
learner's chunked log-softmax over them, `fused` (learner/fused_head.py) never holds more than one chunk.
Times are the fastest of `--rounds` (CUDA-synchronised on a GPU); peak is the memory allocated above what
was held before (the CUDA allocator's peak, or the resident-set growth on CPU), so ratios compare the two.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.model_configs import transformers_config
from benchmarks.step_measures import peak_growth
from learner.batch import token_logprobs_and_entropy
from learner.fused_head import fused_token_logprobs


def _whole(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logprobs, entropy = token_logprobs_and_entropy(hidden @ weight.T, ids)
    return logprobs.sum() + entropy.sum()


def _fused(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logprobs, entropy = fused_token_logprobs(hidden, weight, ids, with_entropy=True)
    return logprobs.sum() + entropy.sum()


def _measure(
    objective: Callable, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, rounds: int
) -> tuple[float, int]:
    """Fastest forward + backward in seconds, and its peak memory in bytes above what was held before it."""
    cuda = hidden.is_cuda

    def step() -> None:
        hidden.grad = weight.grad = None
        objective(hidden, weight, ids).backward()
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    hidden.grad = weight.grad = None
    return min(times), peak_growth(step)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="smollm2-135m", help="benchmarks/model_configs.py's names")
    parser.add_argument("--tokens", type=int, default=4096, help="positions in the micro-batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on CPU")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = transformers_config(args.model_config)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, config.hidden_size, generator=gen).to(device, dtype).requires_grad_()
    weight = (0.02 * torch.randn(config.vocab_size, config.hidden_size, generator=gen)).to(device, dtype)
    weight.requires_grad_()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=gen).to(device)
    results = {
        label: _measure(objective, hidden, weight, ids, args.rounds)
        for label, objective in (("whole", _whole), ("fused", _fused))
    }
    print(
        f"{args.model_config} output layer ({config.vocab_size} x {config.hidden_size}), {args.tokens} positions, "
        f"{dtype}, {device.type}; forward + backward of log-probs and entropy, fastest of {args.rounds}"
    )
    print(f"{'path':<8} {'seconds':>9} {'x whole':>8} {'peak MiB':>9} {'x whole':>8}")
    base_time, base_peak = results["whole"]
    for label, (seconds, peak) in results.items():
        print(
            f"{label:<8} {seconds:>9.3f} {seconds / base_time:>8.2f} {peak / 2**20:>9.0f} "
            f"{peak / max(base_peak, 1):>8.2f}"
        )


if __name__ == "__main__":
    main()
