"""Weight sync through the Ray object store, next to raw `ray.put`/`ray.get` of the same bytes and to
a learner step, all measured in one run on a local Ray cluster.

    python -m benchmarks.weight_sync [--job deploy/jobs/demo.yaml] [--rounds 10]

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
Each figure is the fastest of `--rounds` interleaved rounds (noise only adds time).
"""

from __future__ import annotations

import argparse
import time

import torch


def _job_and_model(job_file: str):
    from cluster.job import job_task, load_job
    from cluster.run.model_prep import prepare_model

    job = load_job(job_file)
    return job, prepare_model(job, job_task(job))


def _batch(job, vocab: int):
    from learner.batch import collate

    gen = torch.Generator().manual_seed(0)
    samples, group = [], job.generator.samples_per_prompt
    for i in range(job.learner.prompts_per_step * group):
        completion = torch.randint(3, vocab, (job.generator.max_new_tokens,), generator=gen).tolist()
        samples.append(dict(prompt_ids=torch.randint(3, vocab, (24,), generator=gen).tolist(),
                            completion_ids=completion, behaviour_logprobs=[-6.0] * len(completion),
                            reward=float(i % 2), group_id=i // group, version=0))
    return collate(samples, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--rounds", type=int, default=10)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    import numpy as np
    import ray

    from cluster.run import runtime
    from cluster.run.driver import _generator_spec, _learner_spec

    job, model_path = _job_and_model(args.job)
    runtime.connect(None, 3, "stableasync-bench")
    learners = runtime.LearnerGroup(_learner_spec(job, model_path), 1, 1.0, 0.0)
    generator_spec = _generator_spec(job, model_path)
    generator = runtime.start_generator(generator_spec, 0, 1.0)
    ray.get(generator.ready.remote())

    @ray.remote(num_cpus=0)
    class Writer:
        def put(self, size: int) -> list[ray.ObjectRef]:
            return [ray.put(np.ones(size, dtype=np.uint8))]

    @ray.remote(num_cpus=0)
    class Reader:
        def get(self, refs: list[ray.ObjectRef]) -> int:
            return int(ray.get(refs[0]).nbytes)

    weights_ref = learners.publish(generator_spec.dtype)
    size = ray.get(weights_ref).nbytes
    from transformers import AutoConfig

    batch = _batch(job, vocab=AutoConfig.from_pretrained(model_path).vocab_size)
    writer, reader = Writer.remote(), Reader.remote()
    sync_s, reload_s, raw_s, step_s = [], [], [], []
    for version in range(1, args.rounds + 1):
        start = time.perf_counter()
        reload_s.append(ray.get(generator.update_weights.remote(learners.publish(generator_spec.dtype), version)))
        sync_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get(reader.get.remote(ray.get(writer.put.remote(size))))
        raw_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get(learners.train_step([batch]))
        step_s.append(time.perf_counter() - start)
    transport_s = [sync - reload for sync, reload in zip(sync_s, reload_s)]
    sync, reload, transport, raw, step = min(sync_s), min(reload_s), min(transport_s), min(raw_s), min(step_s)
    mib = size / 2**20
    print(f"model {model_path}: {mib:.2f} MiB of weights; best of {args.rounds} interleaved rounds\n")
    print(f"{'path':<46}{'seconds':>9}{'MiB/s':>10}")
    print(f"{'sync (gather, put, get, vLLM reload)':<46}{sync:>9.4f}{mib / sync:>10.1f}")
    print(f"{'  object-store path (sync minus reload)':<46}{transport:>9.4f}{mib / transport:>10.1f}")
    print(f"{'  vLLM reload in the generator':<46}{reload:>9.4f}")
    print(f"{'raw ray.put + ray.get':<46}{raw:>9.4f}{mib / raw:>10.1f}")
    print(f"{'learner step':<46}{step:>9.4f}")
    print(f"\nobject-store path bandwidth / raw bandwidth: {raw / transport:.2f} (goal >= 0.50)")
    print(f"object-store path / learner step time:       {transport / step:.3f} (goal <= 0.05)")
    print(f"whole sync, reload included / learner step:  {sync / step:.3f}")
    learners.shutdown()
    runtime.stop_generator(generator)
    ray.shutdown()


if __name__ == "__main__":
    main()
