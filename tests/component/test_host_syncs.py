"""No host synchronisation inside the learner step's micro-batch loop.

On a GPU every read of a device value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, a Python
branch on a tensor) waits for every kernel queued before it, and the GPU idles while the host catches up.
A step may read a few values once (the plan, the agreed micro-batch count, the finiteness check, the
optimizer's overflow check, the metrics), never once per micro-batch. On CPU the reads still pass through
the dispatcher (`_local_scalar_dense`, `is_nonzero`) or through `Tensor.tolist`, so they are counted here.
"""

from __future__ import annotations

import collections
import traceback

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.component.test_learner import _free_port, _leave_group

aten = torch.ops.aten
# The step's own reads, once each, plus DeepSpeed's overflow check and gradient norm (3) and a
# stabilizer's global decision (M2PO's threshold, VCPO's learning-rate scale): a ceiling with room for one more.
MOST_READS_PER_STEP = 16


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values on the host, by the line of project code that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()
        self._tolist = torch.Tensor.tolist

    def _count(self) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "site-packages" not in f.filename]
        frame = frames[-1]
        self.where[f"{frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno}"] += 1

    def __enter__(self):
        reads = self

        def tolist(tensor):
            reads._count()
            return reads._tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten._local_scalar_dense, aten.is_nonzero):
            self._count()
        return func(*args, **(kwargs or {}))


def test_every_kind_of_host_read_is_counted():
    value = torch.tensor([1.5, 2.0])
    with HostReads() as reads:
        float(value[0])
        value[1].item()
        bool(value[0] > 1)
        value.tolist()
        value * 2  # stays on the device
    assert sum(reads.where.values()) == 4


CASES = (("tis_seq", {}), ("vcpo", {"opob_impl": "bookkeeping"}), ("vcpo", {"opob_impl": "ghost"}), ("m2po", {}))
# budgets of 2 and 4 micro-batches of packed rows counted by their real tokens (1472 in all, 368 a prompt group of
# 8), VCPO's holding whole groups
BUDGETS = {"tis_seq": (1024, 400), "m2po": (1024, 400), "vcpo": (1024, 512)}


def _reads_main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    gen = torch.Generator().manual_seed(0)
    samples = [
        dict(
            prompt_ids=torch.randint(3, 200, (16,), generator=gen).tolist(),
            completion_ids=torch.randint(3, 200, (16 + 4 * (i % 8),), generator=gen).tolist(),
            reward=float(i % 3 == 0),
            group_id=i // 8,
            version=0,
        )
        for i in range(32)
    ]
    for sample in samples:
        sample["behaviour_logprobs"] = (-6.0 + torch.randn(len(sample["completion_ids"]), generator=gen)).tolist()
    batch = collate(samples, 0)
    results = {}
    for name, config in CASES:
        for budget in BUDGETS[name]:
            spec = LearnerSpec(
                model_path=model_path,
                learning_rate=1e-6,
                stabilizer_name=name,
                stabilizer_config=registry.build(name, **config).config,
                loss_aggregation="seq-mean-token-mean",
                max_tokens_per_micro_batch=budget,
            )
            learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
            learner.train_step(batch)  # warm-up
            with HostReads() as reads:
                metrics = learner.train_step(batch)
            results[(name, config.get("opob_impl"), budget)] = {
                "micro_batches": metrics["perf/micro_batches"],
                "reads": dict(reads.where),
                "skipped": metrics["stability/skipped_step"],
            }
    torch.save(results, out)
    _leave_group()


def test_the_step_reads_the_device_a_few_times_whatever_its_micro_batch_count(tiny_qwen2, tmp_path):
    """tis_seq and M2PO (one pass and two), VCPO by book-keeping and by ghost norms: all in one process."""
    out = tmp_path / "reads.pt"
    mp.start_processes(
        _reads_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True
    )
    results = torch.load(out, weights_only=False)
    for name, config in CASES:
        two, four = (results[(name, config.get("opob_impl"), budget)] for budget in BUDGETS[name])
        assert (two["micro_batches"], four["micro_batches"]) == (2, 4), name
        assert two["skipped"] == four["skipped"] == 0, name
        assert sum(four["reads"].values()) == sum(two["reads"].values()), (name, config, two["reads"], four["reads"])
        assert sum(four["reads"].values()) <= MOST_READS_PER_STEP, (name, config, four["reads"])
