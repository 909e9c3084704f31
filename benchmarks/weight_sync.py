"""Weight sync through the Ray object store, next to raw `ray.put`/`ray.get` of the same bytes and to
a learner step, all measured in one run on a local Ray cluster.

    python -m benchmarks.weight_sync [--job deploy/jobs/demo.yaml] [--rounds 10]

- sync: what the driver does after every step on the object-store path: the learner ranks gather the
  full weights and rank 0 puts them in the object store, and the generator reads them and reloads its
  vLLM engine in place (`update_weights`), timed until that load returns.
  The generator's own timing of its vLLM reload is printed beneath: the part no transport can remove.
- raw: one actor `ray.put`s a buffer of the same size, another `ray.get`s it: the transport alone.
- step: the learner's `train_step` on a batch the size of the job's (prompts_per_step x
  samples_per_prompt sequences of prompt + max_new_tokens tokens).
Each figure is the fastest of `--rounds` interleaved rounds (noise only adds time).
"""

from __future__ import annotations

import argparse
import time

import torch


def _job_and_model(job_file: str):
    from cluster.job import load_job, section_config
    from cluster.model_prep import prepare_model
    from tasks.base import build_task
    from tasks.config import TASK_CONFIGS

    job = load_job(job_file)
    return job, prepare_model(job, build_task(job.task.name, section_config(job.task, TASK_CONFIGS)))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    import numpy as np
    import ray

    from cluster import runtime
    from cluster.driver import _generator_spec, _learner_spec

    job, model_path = _job_and_model(args.job)
    runtime.connect(None, 3, "stableasync-bench")
    learners = runtime.LearnerGroup(_learner_spec(job, model_path), 1, 1.0, 0.0)
    generator = runtime.start_generator(_generator_spec(job, model_path), 0, 1.0, 0.0)
    ray.get(generator.ready.remote())

    @ray.remote(num_cpus=0)
    class Holder:
        def put(self, size: int) -> list[ray.ObjectRef]:
            return [ray.put(np.ones(size, dtype=np.uint8))]

    @ray.remote(num_cpus=0)
    def fetch_s(refs: list[ray.ObjectRef]) -> float:
        start = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - start

    weights_ref = learners.publish()
    size = int(sum(t.numel() * t.element_size() for t in ray.get(weights_ref).values()))
    from transformers import AutoConfig

    batch = _batch(job, vocab=AutoConfig.from_pretrained(model_path).vocab_size)
    holder = Holder.remote()
    sync_s, reload_s, raw_s, step_s = [], [], [], []
    for version in range(1, args.rounds + 1):
        start = time.perf_counter()
        reload_s.append(ray.get(generator.update_weights.remote(learners.publish(), version)))
        sync_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        refs = ray.get(holder.put.remote(size))
        put_s = time.perf_counter() - start
        raw_s.append(put_s + ray.get(fetch_s.remote(refs)))
        del refs
        start = time.perf_counter()
        ray.get(learners.train_step([batch]))
        step_s.append(time.perf_counter() - start)
    sync, reload, raw, step = min(sync_s), min(reload_s), min(raw_s), min(step_s)
    print(f"model {model_path}: {size / 2**20:.2f} MiB of weights; best of {args.rounds} interleaved rounds\n")
    print(f"{'path':<34}{'seconds':>9}{'MiB/s':>10}")
    print(f"{'sync (gather, put, get, reload)':<34}{sync:>9.4f}{size / 2**20 / sync:>10.1f}")
    print(f"{'  of which vLLM reload':<34}{reload:>9.4f}")
    print(f"{'raw ray.put + ray.get':<34}{raw:>9.4f}{size / 2**20 / raw:>10.1f}")
    print(f"{'learner step':<34}{step:>9.4f}")
    print(f"\nsync bandwidth / raw bandwidth: {raw / sync:.2f} (goal >= 0.50)")
    print(f"sync / learner step time:       {sync / step:.3f} (goal <= 0.05)")
    learners.shutdown()
    ray.kill(generator)
    ray.shutdown()


if __name__ == "__main__":
    main()
