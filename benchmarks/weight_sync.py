"""Weight sync through the Ray object store, next to raw `ray.put`/`ray.get` of the same bytes and to
a learner step, all measured in one run on a local Ray cluster.

    python -m benchmarks.weight_sync [--job deploy/jobs/demo.yaml] [--rounds 10] [--lora-rank 16]

- sync: what the driver does after every step on the object-store path: the learner ranks gather the
  full weights and rank 0 puts them in the object store as one `PackedWeights` buffer, and the
  generator maps it and reloads its vLLM engine in place (`update_weights`), timed until that load
  returns. Beneath it, split per round: the object-store path (sync minus the reload: gather, put, get
  and the two actor calls) and the generator's own timing of its vLLM reload, which every transport
  pays (NCCL too) and which runs in the generator between its calls, off the learner's path.
- raw: one actor `ray.put`s a buffer of the same size, another `ray.get`s it: the transport alone,
  timed from the driver over the same two actor calls the sync makes (tell the learner to publish,
  tell the generator to load).
- step: the learner's `train_step` on a batch the size of the job's (prompts_per_step x
  samples_per_prompt sequences of prompt + max_new_tokens tokens).
Each figure is the fastest of `--rounds` interleaved rounds (noise only adds time). With `--lora-rank R` the
same measurements run again on the job with `model.lora` (rank R, every linear layer), where only the adapter
is sent and the generator loads it as a vLLM LoRA, and a last table sets the two side by side.
"""

from __future__ import annotations

import argparse
import time

import torch


def _batch(job, vocab: int):
    from learner.batch import collate

    gen = torch.Generator().manual_seed(0)
    samples, group = [], job.generator.samples_per_prompt
    for i in range(job.learner.prompts_per_step * group):
        completion = torch.randint(3, vocab, (job.generator.max_new_tokens,), generator=gen).tolist()
        samples.append(
            dict(
                prompt_ids=torch.randint(3, vocab, (24,), generator=gen).tolist(),
                completion_ids=completion,
                behaviour_logprobs=[-6.0] * len(completion),
                reward=float(i % 2),
                group_id=i // group,
                version=0,
            )
        )
    return collate(samples, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also measure the job with model.lora at this rank (every linear layer), side by side",
    )
    return parser


def _measure(job, model_path: str, rounds: int) -> dict[str, float]:
    """The fastest of `rounds` interleaved sync, raw-transport and learner-step rounds of one job."""
    import numpy as np
    import ray
    from transformers import AutoConfig

    from cluster.run import generator_actors, learner_group
    from cluster.run.specs import generator_spec, learner_spec

    learners = learner_group.LearnerGroup(learner_spec(job, model_path), 1, 1.0, 0.0)
    spec = generator_spec(job, model_path)
    generator = generator_actors.start_generator(spec, 0, 1.0)
    learners.wait_until_ready()
    ray.get(generator.ready.remote())

    @ray.remote(num_cpus=0)
    class Writer:
        def put(self, size: int) -> list[ray.ObjectRef]:
            return [ray.put(np.ones(size, dtype=np.uint8))]

    @ray.remote(num_cpus=0)
    class Reader:
        def get(self, refs: list[ray.ObjectRef]) -> int:
            return int(ray.get(refs[0]).nbytes)

    size = ray.get(learners.publish(spec.dtype)).nbytes
    batch = _batch(job, vocab=AutoConfig.from_pretrained(model_path).vocab_size)
    writer, reader = Writer.remote(), Reader.remote()
    sync_s, reload_s, raw_s, step_s = [], [], [], []
    for version in range(1, rounds + 1):
        start = time.perf_counter()
        reload_s.append(ray.get(generator.update_weights.remote(learners.publish(spec.dtype), version)))
        sync_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get(reader.get.remote(ray.get(writer.put.remote(size))))
        raw_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get(learners.train_step([batch]))
        step_s.append(time.perf_counter() - start)
    learners.shutdown()
    generator_actors.stop_generator(generator)
    transport_s = [sync - reload for sync, reload in zip(sync_s, reload_s)]
    return {
        "mib": size / 2**20,
        "sync": min(sync_s),
        "reload": min(reload_s),
        "transport": min(transport_s),
        "raw": min(raw_s),
        "step": min(step_s),
    }


def _print(label: str, model_path: str, rounds: int, r: dict[str, float]) -> None:
    mib = r["mib"]
    print(f"{label}: model {model_path}: {mib:.2f} MiB of weights sent; best of {rounds} interleaved rounds\n")
    print(f"{'path':<46}{'seconds':>9}{'MiB/s':>10}")
    print(f"{'sync (gather, put, get, vLLM reload)':<46}{r['sync']:>9.4f}{mib / r['sync']:>10.1f}")
    print(f"{'  object-store path (sync minus reload)':<46}{r['transport']:>9.4f}{mib / r['transport']:>10.1f}")
    print(f"{'  vLLM reload in the generator':<46}{r['reload']:>9.4f}")
    print(f"{'raw ray.put + ray.get':<46}{r['raw']:>9.4f}{mib / r['raw']:>10.1f}")
    print(f"{'learner step':<46}{r['step']:>9.4f}")
    print(f"\nobject-store path bandwidth / raw bandwidth: {r['raw'] / r['transport']:.2f} (goal >= 0.50)")
    print(f"object-store path / learner step time:       {r['transport'] / r['step']:.3f} (goal <= 0.05)")
    print(f"whole sync, reload included / learner step:  {r['sync'] / r['step']:.3f}\n")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    import ray

    from cluster.job import job_task, load_job
    from cluster.run import ray_cluster
    from cluster.run.model_prep import prepare_model

    variants = {"full fine-tuning": ()}
    if args.lora_rank:
        variants[f"LoRA rank {args.lora_rank}"] = (f"model.lora={{rank: {args.lora_rank}}}",)
    ray_cluster.connect(None, 3, "stableasync-bench")
    results = {}
    for label, overrides in variants.items():
        job = load_job(args.job, overrides)
        model_path = prepare_model(job, job_task(job))
        results[label] = _measure(job, model_path, args.rounds)
        _print(label, model_path, args.rounds, results[label])
    ray.shutdown()
    if len(results) == 2:
        full, lora = results.values()
        print(f"{'per step, LoRA / full fine-tuning':<40}{'full':>10}{'LoRA':>10}{'ratio':>8}")
        rows = (("mib", "MiB sent"), ("sync", "sync s"), ("reload", "vLLM load s"), ("step", "learner step s"))
        for key, name in rows:
            print(f"{name:<40}{full[key]:>10.4f}{lora[key]:>10.4f}{lora[key] / full[key]:>8.3f}")


if __name__ == "__main__":
    main()
