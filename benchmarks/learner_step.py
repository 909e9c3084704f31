"""Learner step time and peak memory of `none`, `tis_seq`, VCPO's per-sample-norm paths and the decoupled objective.

    python -m benchmarks.learner_step [--sequences 64] [--tokens 512] [--rounds 3] [--job deploy/jobs/demo.yaml]
        [--model-config smollm2-135m] [--budget 8192] [--configs tis_seq,vcpo-auto] [--dtype bfloat16]
        [--profile tis_seq,vcpo-auto] [--lengths lognormal:256:1024] [--flops]

One learner rank (DeepSpeed ZeRO-2: nccl and bfloat16 on a CUDA GPU, else gloo and float32 on the CPU) on
the job's model, or on `--model-config`'s published architecture with random weights (benchmarks/model_configs.py:
the shapes set the cost, not the weights), one full train_step (forward, per-sample norms where VCPO needs them,
loss, backward, optimizer step) on `--sequences` sequences of `--tokens` tokens in groups of 8, in
micro-batches of `--budget` tokens (the job default).
Each configuration runs in a process of its own, one after the other (a real model's configurations do
not fit in one process together), and its row prints as it ends: a warm-up step, `--rounds` timed steps
(ratios to tis_seq use each one's fastest step, since noise only adds time; the median beside it), then one
step whose peak memory above what the process held when it began is its memory: activations, gradients and
the per-sample-norm temporaries, not the model or optimizer state every configuration holds. On a GPU that
is the CUDA allocator's peak; on the CPU the growth of the kernel's resident-set high-water mark after
malloc_trim.
`held MiB` is what the process holds once the learner is built and has taken its first step (CUDA memory
allocated, or the resident set): the model, its optimizer state and anything a configuration keeps beside
them (the KL's reference copy). `--profile` runs one more step of each named configuration (all, without
names) under torch.profiler and prints the share of it some GPU kernel was running and its top kernels.
`--flops` runs one more step of each under torch's FlopCounterMode and prints its FLOPs against tis_seq's and
how many backward passes went through the model per micro-batch (a plain step takes one).

`--lengths lognormal:MEAN:MAX` draws each response's length instead (fixed seed): log-normal with mean MEAN and
a 4x spread (the 90th percentile 4 times the 10th), clipped to [32, MAX] tokens. A configuration named
`-padded` runs its stabilizer with learner.packed_micro_batches off (right-padded rows, a budget of rows x
longest row); the table then gives each one's real tokens per second and, for each pair, packed over padded.
`-logits`: learner.fused_output_layer off, the model's own [tokens, vocabulary] logits (VCPO's norms from them).
`-compiled`: learner.compile layers, each decoder layer compiled by inductor in the warm-up step.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from typing import Any

import torch

from benchmarks.step_measures import (
    counted_step,
    default_dtype,
    device_name,
    held_bytes,
    on_cuda,
    peak_growth,
    print_profile,
    profile_step,
    timed_seconds,
)
from learner.lora import LoraSpec
from learner.ports import listenable_port

EVERY_LINEAR_LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# label -> (stabilizer, its config, LearnerSpec options)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "none": ("none", {}, {}),
    "tis_seq": ("tis_seq", {}, {}),
    "vcpo-loop": ("vcpo", {"opob_impl": "per_sample_loop"}, {}),
    "vcpo-ghost": ("vcpo", {"opob_impl": "ghost"}, {}),
    "vcpo-bookkeeping": ("vcpo", {"opob_impl": "bookkeeping"}, {}),
    "vcpo-auto": ("vcpo", {"opob_impl": "auto"}, {}),  # the default
    "m2po": ("m2po", {}, {}),  # a no-grad pass over the batch first when it takes several micro-batches
    # learner.packed_micro_batches false: right-padded rows, the budget counting rows x longest row
    "tis_seq-padded": ("tis_seq", {}, {"packed_micro_batches": False}),
    "m2po-padded": ("m2po", {}, {"packed_micro_batches": False}),
    "vcpo-auto-padded": ("vcpo", {"opob_impl": "auto"}, {"packed_micro_batches": False}),
    "tis_seq-logits": ("tis_seq", {}, {"fused_output_layer": False}),  # the model's own [N, V] logits
    "vcpo-auto-logits": ("vcpo", {"opob_impl": "auto"}, {"fused_output_layer": False}),
    # learner.gradient_checkpointing: activations recomputed layer by layer in the backward
    "tis_seq-gc": ("tis_seq", {}, {"gradient_checkpointing": True}),
    # learner.compile: layers, each decoder layer compiled by inductor (at the warm-up step)
    "tis_seq-compiled": ("tis_seq", {}, {"compiled_layers": "inductor"}),
    "m2po-compiled": ("m2po", {}, {"compiled_layers": "inductor"}),
    # algorithm.proximal: recompute, with one update and with learner.mini_batches 2 x learner.epochs 2
    "tis_seq-recompute": ("tis_seq", {}, {"proximal": "recompute"}),
    "tis_seq-recompute-2x2": ("tis_seq", {}, {"proximal": "recompute", "mini_batches": 2, "epochs": 2}),
    # algorithm.kl (a frozen reference copy on the rank) and algorithm.entropy_coef
    "tis_seq-kl": ("tis_seq", {}, {"kl_coef": 1e-3}),
    "tis_seq-entropy": ("tis_seq", {}, {"entropy_coef": 1e-3}),
    # model.lora rank 16 on every linear layer: adapter gradients and optimizer state only
    "tis_seq-lora": ("tis_seq", {}, {"lora": LoraSpec(16, 32.0, 0.0, EVERY_LINEAR_LAYER)}),
}
REFERENCE = "tis_seq"
GROUP_SIZE = 8
PROMPT_TOKENS = 16
SHORTEST_RESPONSE = 32
SPREAD = 4.0  # --lengths: the 90th percentile over the 10th
P90_Z = 1.2815515655446004  # the standard normal's 90th percentile


def _model_path(job_file: str) -> str:
    from cluster.job import load_job
    from cluster.run.model_prep import prepare_model
    from tasks.base import build_task

    job = load_job(job_file)
    return prepare_model(job, build_task(job.task.name, job.task))


def response_lengths(spec: str | None, sequences: int, tokens: int) -> list[int]:
    """Each response's tokens: `tokens` less the prompt for all, or `lognormal:MEAN:MAX` drawn with a fixed seed
    (mean MEAN, the 90th percentile SPREAD times the 10th, clipped to [SHORTEST_RESPONSE, MAX])."""
    if spec is None:
        return [tokens - PROMPT_TOKENS] * sequences
    kind, mean, most = spec.split(":")
    if kind != "lognormal":
        raise ValueError(f"--lengths: {kind!r} is not a known distribution (lognormal:MEAN:MAX)")
    sigma = math.log(SPREAD) / (2 * P90_Z)
    mu = math.log(float(mean)) - sigma**2 / 2
    gen = torch.Generator().manual_seed(0)
    drawn = torch.exp(mu + sigma * torch.randn(sequences, generator=gen, dtype=torch.float64))
    return drawn.round().clamp(SHORTEST_RESPONSE, int(most)).long().tolist()


def synthetic_batch(sequences: int, tokens: int, vocab: int, lengths: str | None = None):
    from learner.batch import collate

    gen = torch.Generator().manual_seed(0)
    # near a random-weight model's own log-probs, so that importance weights are neither 0 nor all capped: a
    # step with zero weights would train on zero gradients
    uniform = -math.log(vocab)
    samples = []
    for i, length in enumerate(response_lengths(lengths, sequences, tokens)):
        completion = torch.randint(3, vocab, (length,), generator=gen).tolist()
        samples.append(
            dict(
                prompt_ids=torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist(),
                completion_ids=completion,
                behaviour_logprobs=(uniform + 0.3 * torch.randn(len(completion), generator=gen)).tolist(),
                reward=float(torch.rand((), generator=gen) < 0.5),
                group_id=i // GROUP_SIZE,
                version=0,
            )
        )
    return collate(samples, 0)


def _learner(
    model_path: str,
    name: str,
    config: dict[str, Any],
    options: dict[str, Any],
    port: int,
    budget: int | None,
    dtype: str,
):
    from algorithms import registry
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=1e-6,
        stabilizer_name=name,
        stabilizer_config=registry.build(name, **config).config,
        loss_aggregation="seq-mean-token-mean",
        max_tokens_per_micro_batch=budget,
        dtype=dtype,
        backend="nccl" if on_cuda() else "gloo",
        **options,
    )
    return LearnerRank(spec, 0, 1, "127.0.0.1", port)


def _configuration_child(args: argparse.Namespace, label: str) -> None:
    """One configuration in this process: warm-up, timed steps, the peak-memory step, and the profiled step
    when asked for; one JSON line."""
    name, config, options = CONFIGS[label]
    learner = _learner(args.model_path, name, config, options, args.port, args.budget, args.dtype)
    batch = synthetic_batch(args.sequences, args.tokens, args.vocab, args.lengths)
    metrics = learner.train_step(batch)  # warm-up: optimizer state and allocator pools exist before measuring
    held = held_bytes()
    times = [timed_seconds(lambda: learner.train_step(batch)) for _ in range(args.rounds)]
    peak = peak_growth(lambda: learner.train_step(batch))
    result = {
        "times": times,
        "peak_bytes": peak,
        "held_bytes": held,
        "bookkeeping_share": metrics.get("opob/bookkeeping_share"),
        "tokens": int(batch.attention_mask.sum()),
        "micro_batches": metrics["perf/micro_batches"],
    }
    if args.profile:
        result["profile"] = profile_step(lambda: learner.train_step(batch))
    if args.flops:
        result["flops"], result["model_backwards"] = counted_step(
            learner.engine.module, lambda: learner.train_step(batch)
        )
    print(json.dumps(result))


def _labels(text: str, option: str, parser: argparse.ArgumentParser) -> list[str]:
    labels = [label.strip() for label in text.split(",") if label.strip()]
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        parser.error(f"{option}: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    return labels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="prompt plus completion tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml", help="the job whose model is measured")
    parser.add_argument(
        "--model-config",
        help="measure this model instead of the job's: a published architecture with random "
        "weights (smollm2-135m, qwen2.5-1.5b, qwen2.5-7b) or a model folder",
    )
    parser.add_argument("--budget", type=int, default=8192, help="learner.max_tokens_per_micro_batch")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} ({REFERENCE} is always measured)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="the learner's model.dtype (default: bfloat16 on a CUDA GPU, float32 on the CPU)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="all",
        metavar="CONFIGS",
        help="one more step of these configurations (comma-separated; all measured ones without "
        "names) under torch.profiler: GPU busy share and top kernels",
    )
    parser.add_argument(
        "--flops",
        action="store_true",
        help="one more step of each configuration under torch's FlopCounterMode: its FLOPs against tis_seq's, and "
        "the backward passes through the model per micro-batch",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    parser.add_argument(
        "--lengths",
        metavar="lognormal:MEAN:MAX",
        help="response lengths drawn log-normal (mean MEAN, 90th percentile 4x the 10th, clipped to "
        "[32, MAX]) instead of --tokens for every sequence",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def _configuration_result(
    label: str, args: argparse.Namespace, model_path: str, vocab: int, profiled: bool
) -> dict[str, Any]:
    """One configuration's measurements from a process of its own (`_configuration_child`)."""
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.learner_step",
            "--child",
            label,
            "--model-path",
            model_path,
            "--vocab",
            str(vocab),
            "--port",
            str(listenable_port()),
            "--sequences",
            str(args.sequences),
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            "--rounds",
            str(args.rounds),
            "--budget",
            str(args.budget),
            "--dtype",
            args.dtype,
            *(["--profile"] if profiled else []),
            *(["--flops"] if args.flops else []),
            *(["--lengths", args.lengths] if args.lengths else []),
        ],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        raise SystemExit(f"{label}: its process failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _print_row(label: str, result: dict[str, Any], reference: dict[str, Any]) -> None:
    """A configuration's row against the reference's, and its FLOPs and profile where it measured them."""
    best, median = min(result["times"]), statistics.median(result["times"])
    share = result["bookkeeping_share"]
    print(
        f"{label:<22} {best:>12.3f} {best / min(reference['times']):>10.2f} "
        f"{median / statistics.median(reference['times']):>9.2f} {result['peak_bytes'] / 2**20:>9.0f} "
        f"{result['peak_bytes'] / reference['peak_bytes']:>10.2f} {'-' if share is None else f'{share:.2f}':>9} "
        f"{result['held_bytes'] / 2**20:>9.0f} {result['micro_batches']:>5.0f} "
        f"{result['tokens'] / best:>9.1f}"
    )
    if "flops" in result:
        print(
            f"  flops of {label}: {result['flops'] / 1e9:.1f} GFLOP, {result['flops'] / reference['flops']:.2f}x "
            f"{REFERENCE}; {result['model_backwards'] / result['micro_batches']:.2f} backward passes through "
            "the model per micro-batch"
        )
    if "profile" in result:
        print_profile(label, result["profile"])


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or default_dtype()
    if args.child:
        _configuration_child(args, args.child)
        return
    labels = _labels(args.configs, "--configs", parser)
    labels = [REFERENCE] + [label for label in labels if label != REFERENCE]
    profiled = labels if args.profile == "all" else _labels(args.profile or "", "--profile", parser)

    from benchmarks.model_configs import benchmark_model

    model_path, model, vocab = benchmark_model(parser, args.model_config, args.dtype, lambda: _model_path(args.job))
    memory = "CUDA memory allocated" if on_cuda() else "resident set"
    if args.lengths:
        try:
            drawn = response_lengths(args.lengths, args.sequences, args.tokens)
        except ValueError as error:
            parser.error(str(error))
        real = sum(drawn) + PROMPT_TOKENS * len(drawn)
        print(
            f"model {model}; {args.sequences} sequences of {PROMPT_TOKENS} prompt tokens and responses of "
            f"{min(drawn)}-{max(drawn)} tokens ({args.lengths}, mean {sum(drawn) / len(drawn):.0f}): {real} real "
            f"tokens, {len(drawn) * (max(drawn) + PROMPT_TOKENS)} padded to the longest; micro-batches of "
            f"{args.budget} tokens"
        )
    else:
        print(
            f"model {model}; {args.sequences} sequences x {args.tokens} tokens, micro-batches of {args.budget} tokens"
        )
    print(
        f"{device_name()}, {args.dtype}; ZeRO-2, 1 rank, {args.threads} torch thread(s); {args.rounds} timed steps "
        f"per configuration, each configuration in its own process; memory: {memory}"
    )
    print(
        f"{'configuration':<22} {'step s (min)':>12} {'x tis_seq':>10} {'median x':>9} {'peak MiB':>9}"
        f" {'x tis_seq':>10} {'book-kept':>9} {'held MiB':>9} {'micro':>5} {'tokens/s':>9}",
        flush=True,
    )
    reference: dict[str, Any] | None = None
    results: dict[str, dict[str, Any]] = {}
    for label in labels:
        result = results[label] = _configuration_result(label, args, model_path, vocab, label in profiled)
        reference = reference or result
        _print_row(label, result, reference)
        sys.stdout.flush()
    for label, result in results.items():
        padded = results.get(f"{label}-padded")
        if padded is not None:
            print(
                f"{label}: packed tokens/s x padded: {min(padded['times']) / min(result['times']):.2f} (fastest "
                f"steps), {statistics.median(padded['times']) / statistics.median(result['times']):.2f} (medians)"
            )


if __name__ == "__main__":
    main()
