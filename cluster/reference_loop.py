"""The whole method in one synchronous loop, without Ray: read this first.

    python -m cluster.reference_loop deploy/jobs/demo.yaml --steps 60

One generator (vLLM, in this process) samples a group of responses per prompt with the current
weights; the task scores each response; one learner rank (DeepSpeed) takes one stabilized step on the
groups; the new weights go back to the generator. Every sample is on-policy here (lag 0), so the
stabilizer's weights are all 1 up to the numerics of two engines; with `async.fixed_lag: K` each step's
samples wait K steps in a queue first, so every step from K on trains samples exactly K versions old.

`stableasync train` (cluster/run/driver.py) runs the same parts asynchronously: generators in Ray actors
keep sampling with weights up to `async.max_lag` versions old while the learner, on several ranks,
trains on what is ready; that staleness is what the stabilizers correct. It adds what a long run
needs: evaluation, checkpoints and resume, restarts, elastic generators, metrics and alerts.
"""

from __future__ import annotations

import argparse
import os
import random
from collections import deque
from pathlib import Path
from statistics import mean

from actors.buffer import ScoredGroup
from actors.generator import GeneratedGroup, GenerationRequest, Generator
from cluster.job import Job, job_task, load_job
from cluster.run.model_prep import prepare_model, sft_samples
from cluster.run.specs import generator_spec, learner_spec
from learner.batch import collate
from learner.ports import listenable_port
from learner.rank import LearnerRank
from learner.records import TrainingSample
from learner.weight_sync import PackedWeights
from tasks.base import Problem, Task
from tasks.records import ScoredCompletion
from tasks.scoring import score_inline


def training_samples(task: Task, problems: list[Problem], groups: list[GeneratedGroup]) -> list[TrainingSample]:
    """Each response with its reward, the prompt's group id and the behaviour log-probs of its tokens."""
    samples: list[TrainingSample] = []
    for problem, group in zip(problems, groups):
        texts = [completion["text"] for completion in group.completions]
        scores = score_inline(task, [problem] * len(texts), texts)
        completions = [
            ScoredCompletion(**completion, reward=score.reward, score_error=score.error)
            for completion, score in zip(group.completions, scores)
        ]
        samples += ScoredGroup(
            group.group_id,
            group.problem_id,
            group.prompt_ids,
            completions,
            group.version_start,
            group.version_end,
            group.generator_index,
        ).samples()
    return samples


def run(job: Job, steps: int) -> list[float]:
    """Train `steps` RL steps after the job's supervised warm-up; the mean reward of each step's samples."""
    task = job_task(job)
    model_path = prepare_model(job, task)  # the tiny model is built offline; SmolLM2 comes from its wheel
    learner = LearnerRank(
        learner_spec(job, model_path), rank=0, world_size=1, master_addr="127.0.0.1", master_port=listenable_port()
    )
    generator = Generator(generator_spec(job, model_path))

    # A short supervised warm-up teaches the answer format, so that some rewards are above 0.
    demonstrations = task.problems("sft", job.seed + 1)
    for _ in range(job.model.sft_warmup.steps):
        problems = [next(demonstrations) for _ in range(job.model.sft_warmup.prompts_per_step)]
        learner.sft_step(collate(sft_samples(model_path, task, problems), 0), job.model.sft_warmup.learning_rate)
    generator.update_weights(_weights(learner, generator.spec.dtype), version=0)

    problems_stream, seeds, rewards = task.problems("train", job.seed), random.Random(job.seed), []
    lag = job.async_.fixed_lag or 0
    queued: deque[list[TrainingSample]] = deque()  # sampled batches, the next step's first
    for step in range(steps):
        # 1. sample: one group of responses per prompt, with the weights of version `step`, for step `step + lag`
        #    (version 0 samples steps 0 to lag: there is no older policy)
        while len(queued) <= lag and step + len(queued) < steps:
            problems = [next(problems_stream) for _ in range(job.learner.prompts_per_step)]
            requests = [
                GenerationRequest(
                    group_id=i, problem_id=p.problem_id, messages=task.messages(p), seed=seeds.getrandbits(31)
                )
                for i, p in enumerate(problems)
            ]
            groups = generator.generate(requests)
            # 2. score every response
            queued.append(training_samples(task, problems, groups))
        samples = queued.popleft()
        # 3. one learner step: advantages within each group, the stabilizer's weights, the loss, the update
        metrics = learner.train_step(collate(samples, 0))
        # 4. the new weights (version step + 1) to the generator
        generator.update_weights(_weights(learner, generator.spec.dtype), version=step + 1)
        rewards.append(mean(sample["reward"] for sample in samples))
        print(
            f"step {step + 1}: lag {step - samples[0]['version']}, reward {rewards[-1]:.3f}, "
            f"ESS ratio {metrics['stability/ess_ratio']:.3f}, "
            f"loss {metrics['optim/loss']:.4f}",
            flush=True,
        )
    return rewards


def _weights(learner: LearnerRank, dtype: str) -> PackedWeights:
    """The learner's weights packed in `dtype` for the generator (rank 0, the only one here, packs them)."""
    weights = learner.packed_weights_for_publish(dtype)
    assert weights is not None
    return weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster.reference_loop", description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path, help="a job file; its model, task, generator and learner settings")
    parser.add_argument("--steps", type=int, default=60, help="RL steps after the warm-up")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rewards = run(load_job(args.job), args.steps)
    window = max(1, min(10, len(rewards) // 2))
    print(
        f"mean reward: first {window} steps {mean(rewards[:window]):.3f}, last {window} steps "
        f"{mean(rewards[-window:]):.3f}"
    )


if __name__ == "__main__":
    main()
