"""Learner step time and peak memory of `none`, `tis_seq`, VCPO's per-sample-norm paths and the decoupled objective.

    python -m benchmarks.learner_step [--sequences 64] [--tokens 512] [--rounds 3] [--job deploy/jobs/demo.yaml]
        [--budget 8192] [--configs tis_seq,vcpo-auto]

One learner rank (DeepSpeed ZeRO-2 on gloo, the CPU stack) on the job's model, one full train_step
(forward, per-sample norms where VCPO needs them, loss, backward, optimizer step) on `--sequences`
sequences of `--tokens` tokens in groups of 8, in micro-batches of `--budget` tokens (the job default).
Each configuration runs in a process of its own, one after the other (a real model's configurations do
not fit in one process together): a warm-up step, `--rounds` timed steps (ratios to tis_seq use each
one's fastest step, since noise only adds time; the median beside it), then one step whose peak
resident-set growth (sampled every millisecond, after malloc_trim) is its memory: activations,
gradients and the per-sample-norm temporaries, not the model or optimizer state every configuration holds.
`held MiB` is the process's resident memory once the learner is built and has taken its first step: the
model, its optimizer state and anything a configuration keeps beside them (the KL's reference copy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from learner.lora import LoraSpec

# label -> (stabilizer, its config, LearnerSpec options)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "none": ("none", {}, {}),
    "tis_seq": ("tis_seq", {}, {}),
    "vcpo-loop": ("vcpo", {"opob_impl": "per_sample_loop"}, {}),
    "vcpo-ghost": ("vcpo", {"opob_impl": "ghost"}, {}),
    "vcpo-bookkeeping": ("vcpo", {"opob_impl": "bookkeeping"}, {}),
    "vcpo-auto": ("vcpo", {"opob_impl": "auto"}, {}),  # the default
    # algorithm.proximal: recompute, with one update and with learner.mini_batches 2 x learner.epochs 2
    "tis_seq-recompute": ("tis_seq", {}, {"proximal": "recompute"}),
    "tis_seq-recompute-2x2": ("tis_seq", {}, {"proximal": "recompute", "mini_batches": 2, "epochs": 2}),
    # algorithm.kl (a frozen reference copy on the rank) and algorithm.entropy_coef
    "tis_seq-kl": ("tis_seq", {}, {"kl_coef": 1e-3}),
    "tis_seq-entropy": ("tis_seq", {}, {"entropy_coef": 1e-3}),
    # model.lora rank 16 on every linear layer: adapter gradients and optimizer state only
    "tis_seq-lora": ("tis_seq", {}, {"lora": LoraSpec(16, 32.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"))}),
}
REFERENCE = "tis_seq"
GROUP_SIZE = 8
PROMPT_TOKENS = 16


def _model_path(job_file: str) -> str:
    from cluster.job import load_job
    from cluster.run.model_prep import prepare_model
    from tasks.base import build_task

    job = load_job(job_file)
    return prepare_model(job, build_task(job.task.name, job.task))


def _batch(sequences: int, tokens: int, vocab: int):
    from learner.batch import collate

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(sequences):
        completion = torch.randint(3, vocab, (tokens - PROMPT_TOKENS,), generator=gen).tolist()
        samples.append(dict(
            prompt_ids=torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist(),
            completion_ids=completion,
            behaviour_logprobs=(-6.0 + 0.3 * torch.randn(len(completion), generator=gen)).tolist(),
            reward=float(torch.rand((), generator=gen) < 0.5), group_id=i // GROUP_SIZE, version=0,
        ))
    return collate(samples, 0)


def _learner(model_path: str, name: str, config: dict[str, Any], options: dict[str, Any], port: int,
             budget: int | None):
    from algorithms import registry
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(model_path=model_path, zero_stage=2, learning_rate=1e-6, stabilizer_name=name,
                       stabilizer_config=registry.build(name, **config).config, loss_aggregation="seq-mean-token-mean",
                       max_tokens_per_micro_batch=budget, **options)
    return LearnerRank(spec, 0, 1, "127.0.0.1", port)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_growth(step) -> int:
    """Largest RSS growth while `step()` runs, from a baseline taken after returning freed memory."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = peak = _rss_bytes()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak, _rss_bytes()) - base


def _configuration_child(args: argparse.Namespace, label: str) -> None:
    """One configuration in this process: warm-up, timed steps, then the peak-memory step; one JSON line."""
    name, config, options = CONFIGS[label]
    learner = _learner(args.model_path, name, config, options, args.port, args.budget)
    batch = _batch(args.sequences, args.tokens, args.vocab)
    metrics = learner.train_step(batch)  # warm-up: optimizer state and allocator pools exist before measuring
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    held = _rss_bytes()
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        learner.train_step(batch)
        times.append(time.perf_counter() - start)
    peak = _peak_growth(lambda: learner.train_step(batch))
    print(json.dumps({"times": times, "peak_bytes": peak, "held_bytes": held,
                      "bookkeeping_share": metrics.get("opob/bookkeeping_share")}))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="prompt plus completion tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml", help="the job whose model is measured")
    parser.add_argument("--budget", type=int, default=8192, help="learner.max_tokens_per_micro_batch")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)} ({REFERENCE} is always measured)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        _configuration_child(args, args.child)
        return
    labels = [label.strip() for label in args.configs.split(",") if label.strip()]
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    labels = [REFERENCE] + [label for label in labels if label != REFERENCE]

    from transformers import AutoConfig

    model_path = _model_path(args.job)
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    results = {}
    for label in labels:
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.learner_step", "--child", label, "--model-path", model_path,
             "--vocab", str(vocab), "--port", str(_free_port()), "--sequences", str(args.sequences),
             "--tokens", str(args.tokens), "--threads", str(args.threads), "--rounds", str(args.rounds),
             "--budget", str(args.budget)],
            capture_output=True, text=True,
        )
        if child.returncode != 0:
            raise SystemExit(f"{label}: its process failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
        results[label] = json.loads(child.stdout.strip().splitlines()[-1])

    reference = results[REFERENCE]
    print(f"model {model_path}; {args.sequences} sequences x {args.tokens} tokens, micro-batches of {args.budget} "
          f"tokens; ZeRO-2, 1 rank, {args.threads} torch thread(s); {args.rounds} timed steps per configuration, "
          "each configuration in its own process")
    print(f"{'configuration':<22} {'step s (min)':>12} {'x tis_seq':>10} {'median x':>9} {'peak MiB':>9}"
          f" {'x tis_seq':>10} {'book-kept':>9} {'held MiB':>9}")
    for label, result in results.items():
        best, median = min(result["times"]), statistics.median(result["times"])
        share = result["bookkeeping_share"]
        print(f"{label:<22} {best:>12.3f} {best / min(reference['times']):>10.2f} "
              f"{median / statistics.median(reference['times']):>9.2f} {result['peak_bytes'] / 2**20:>9.0f} "
              f"{result['peak_bytes'] / reference['peak_bytes']:>10.2f} {'-' if share is None else f'{share:.2f}':>9} "
              f"{result['held_bytes'] / 2**20:>9.0f}")


if __name__ == "__main__":
    main()
