"""Each stabilizer's loss time relative to `none`, measured side by side in one run.

    python -m benchmarks.stabilizers [--batch 64] [--tokens 2048] [--rounds 30]

One timed call is token_weights + the aggregated policy-gradient loss + its backward to the
log-probs, on stale-looking inputs: token log-ratios mostly near 0 (std `--base-std`) with a heavy
tail (`--tail-share` of tokens at std `--tail-std`), so M2PO's mask, the caps and the clips are all
active. Rounds interleave the stabilizers so machine noise hits all alike. Ratios to `none` use the
fastest round of each (noise only ever adds time); the median ratio is printed beside it.

The headline ratio ("per step") adds to every call the health metrics the learner logs each step
whatever the stabilizer (ESS, K1/K3 KL, chi^2, M2), as a real step pays them; the batch's cached
log-ratio and ratio are then shared, as in the learner. "loss only" leaves them out, so there `none`
skips the log-ratio that every other stabilizer must compute.

BAPO's cost depends on where its bound walk stops: on these inputs the default runs to the widest
bounds (a single clipped-surrogate pass), while positive_share 0.455 stops it mid-way, which takes
the bucket search over the tokens that change sides; both are listed.

M2PO's trust region and BAPO's walk use the fused CPU scans (algorithms/native.py) when they are
built; the rows marked "[torch path]" time the same stabilizers without them, in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from algorithms import native, registry
from algorithms.aggregation import policy_loss
from algorithms.batch import PolicyBatch
from algorithms.diagnostics import health_metrics
from algorithms.stabilizer import Stabilizer

RECOMMENDED_AGGREGATION = {"gspo": "seq-mean-token-mean", "vcpo": "seq-mean-token-mean"}


def make_inputs(
    batch: int, tokens: int, base_std: float, tail_share: float, tail_std: float, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, tokens, generator=gen) * 4
    log_ratio = torch.randn(batch, tokens, generator=gen) * base_std
    tail = torch.rand(batch, tokens, generator=gen) < tail_share
    log_ratio[tail] = torch.randn(int(tail.sum()), generator=gen) * tail_std
    behaviour = logprobs - log_ratio
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=gen)
    mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)
    advantages = torch.randn(batch, generator=gen)
    return logprobs, behaviour, advantages, mask


@dataclass
class Variant:
    """A stabilizer as timed: built with its options, on the fused scans or the torch path."""

    stabilizer: Stabilizer
    path: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def time_once(variant: Variant, inputs: tuple[torch.Tensor, ...], with_health: bool, calls: int = 5) -> float:
    """Seconds per call, averaged over `calls` back-to-back calls (one sample)."""
    logprobs, behaviour, advantages, mask = inputs
    mode = RECOMMENDED_AGGREGATION.get(variant.stabilizer.name, "token-mean")
    leaves = [logprobs.clone().requires_grad_(True) for _ in range(calls)]
    with variant.path():
        start = time.perf_counter()
        for leaf in leaves:
            batch = PolicyBatch(leaf, behaviour, advantages, mask)
            decision = variant.stabilizer.token_weights(batch)
            policy_loss(batch, decision, mode).backward()
            if with_health:
                health_metrics(batch)
        return (time.perf_counter() - start) / calls


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--base-std", type=float, default=0.05, help="token log-ratio std of most tokens")
    parser.add_argument("--tail-share", type=float, default=0.02, help="share of heavy-tail tokens")
    parser.add_argument("--tail-std", type=float, default=1.5, help="log-ratio std of heavy-tail tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is least noisy)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)

    inputs = make_inputs(args.batch, args.tokens, args.base_std, args.tail_share, args.tail_std)
    names = ["none"] + [name for name in registry.STABILIZERS if name != "none"]
    variants = {name: Variant(registry.build(name)) for name in names}
    variants["m2po(adaptive_clip)"] = Variant(registry.build("m2po", mode="adaptive_clip"))
    variants["bapo(positive_share=0.455)"] = Variant(registry.build("bapo", positive_share=0.455))
    fused = native.module() is not None
    if fused:
        for label in ("m2po", "m2po(adaptive_clip)", "bapo(positive_share=0.455)"):
            variants[f"{label} [torch path]"] = Variant(variants[label].stabilizer, native.turned_off)
    for variant in variants.values():  # warm-up: allocator and first-call costs
        time_once(variant, inputs, True)
    loss_only: dict[str, list[float]] = {label: [] for label in variants}
    per_step: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(args.rounds):
        for label, variant in variants.items():
            loss_only[label].append(time_once(variant, inputs, False))
            per_step[label].append(time_once(variant, inputs, True))

    print(
        f"B={args.batch} T={args.tokens} log-ratio std {args.base_std}, tail {args.tail_share:.0%} at std "
        f"{args.tail_std}; rounds={args.rounds} threads={args.threads}; fused CPU scans: "
        + ("built" if fused else "not built, every row takes the torch path")
    )
    width = max(len(label) for label in variants) + 2
    print(f"{'':<{width}}{'per step: loss + health metrics':^36}{'loss only':^36}".rstrip())
    print(f"{'stabilizer':<{width}}" + f"{'ms':>12}{'x none':>12}{'(median)':>12}" * 2)
    for label in variants:
        row = f"{label:<{width}}"
        for samples in (per_step, loss_only):
            best, base = min(samples[label]), min(samples["none"])
            median_ratio = statistics.median(samples[label]) / statistics.median(samples["none"])
            row += f"{best * 1e3:>12.2f}{best / base:>12.2f}{median_ratio:>12.2f}"
        print(row)


if __name__ == "__main__":
    main()
