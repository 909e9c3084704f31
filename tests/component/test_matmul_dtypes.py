"""Every matrix product of a bf16 VCPO step runs in bf16: what runs on a GPU's tensor cores.

An fp32 product on a GPU leaves the tensor cores idle (VCPO's per-sample norms once ran their Gram and
dense products in fp32 and cost 2.5x a plain step on an H200). A `TorchDispatchMode` sees every aten
op a whole `train_step` runs, below autograd, so this holds on CPU for any device: it counts each
product's FLOPs by the dtype of its operands.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.component.test_learner import _free_port, _leave_group

aten = torch.ops.aten


def _product_flops(func, args) -> int | None:
    """2 x multiply-adds of a matrix product (None for any other op)."""
    packet = getattr(func, "overloadpacket", None)
    if packet in (aten.mm, aten.bmm, aten.mv, aten.dot, aten.vdot):
        a, b = args[0], args[1]
    elif packet in (aten.addmm, aten.baddbmm, aten.addbmm, aten.addmv):
        a, b = args[1], args[2]
    else:
        return None
    columns = b.shape[-1] if b.dim() >= 2 else 1  # a matrix-vector or vector-vector product has one
    return 2 * math.prod(a.shape) * columns


class ProductDtypes(TorchDispatchMode):
    """FLOPs of every matrix product, by the dtype of its first operand."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {}
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flops = _product_flops(func, args)
        if flops is not None:
            dtypes = {str(t.dtype) for t in args if isinstance(t, torch.Tensor) and t.dim() >= 1}
            key = "/".join(sorted(dtypes))
            self.flops[key] = self.flops.get(key, 0) + flops
        return func(*args, **(kwargs or {}))


class LargestVocabularyTensor(TorchDispatchMode):
    """The most numbers of any [*, vocabulary] tensor an operator forms (views, such as the output layer's
    weight transposed, form none), and which operator formed it."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest, self.op = vocab, 0, ("", ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            formed = isinstance(tensor, torch.Tensor) and not func.is_view and tensor.dim() >= 2
            if formed and tensor.shape[-1] == self.vocab and tensor.numel() > self.largest:
                self.largest, self.op = tensor.numel(), (str(func), tuple(tensor.shape))
        return out


def test_the_flop_count_of_each_product_kind():
    a, b, v = torch.ones(3, 4), torch.ones(4, 5), torch.ones(4)
    with ProductDtypes() as mode:
        a @ b  # mm: 2 * 3 * 4 * 5
        torch.bmm(a[None], b[None])  # bmm: the same
        a @ v  # mv: 2 * 3 * 4
        torch.addmm(torch.zeros(3, 5, dtype=torch.bfloat16), a.bfloat16(), b.bfloat16())  # addmm in bf16
    assert mode.flops == {"torch.float32": 120 + 120 + 24, "torch.bfloat16": 120}


LOGIT_CHUNK = 4096


def _step_main(rank: int, model_path: str, opob_impl: str, port: int, out: str) -> None:
    import learner.batch as learner_batch
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        learning_rate=1e-6,
        stabilizer_name="vcpo",
        stabilizer_config=registry.build("vcpo", opob_impl=opob_impl).config,
        dtype="bfloat16",
        loss_aggregation="seq-mean-token-mean",
        max_tokens_per_micro_batch=512,
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    gen = torch.Generator().manual_seed(0)
    samples = [
        dict(
            prompt_ids=torch.randint(3, 200, (16,), generator=gen).tolist(),
            completion_ids=torch.randint(3, 200, (48,), generator=gen).tolist(),
            behaviour_logprobs=(-6.0 + torch.randn(48, generator=gen)).tolist(),
            reward=float(i % 3 == 0),
            group_id=i // 8,
            version=0,
        )
        for i in range(16)
    ]
    batch = collate(samples, 0)
    learner.train_step(batch)  # warm-up: the optimizer state exists
    learner_batch.CHUNK_LOGIT_ELEMENTS = LOGIT_CHUNK  # chunks of a few positions: a whole [N, V] tensor would show
    with ProductDtypes() as mode, LargestVocabularyTensor(learner.engine.module.config.vocab_size) as vocabulary:
        metrics = learner.train_step(batch)
    torch.save({"flops": mode.flops, "metrics": metrics, "vocabulary": (vocabulary.largest, vocabulary.op)}, out)
    _leave_group()


@pytest.mark.parametrize("opob_impl", ["ghost", "bookkeeping"])
def test_a_bf16_vcpo_step_runs_its_products_in_bf16(tiny_qwen2, tmp_path, opob_impl):
    out = tmp_path / "flops.pt"
    mp.start_processes(
        _step_main, args=(tiny_qwen2, opob_impl, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True
    )
    result = torch.load(out, weights_only=False)
    flops = result["flops"]
    total = sum(flops.values())
    fp32 = sum(count for key, count in flops.items() if "float32" in key)
    assert result["metrics"]["opob/bookkeeping_share"] == (1.0 if opob_impl == "bookkeeping" else 0.0)
    assert total > 0 and fp32 <= 0.01 * total, {key: f"{count / total:.1%}" for key, count in flops.items()}
    # no [tokens, vocabulary] logits or gradient: the fused output layer forms one chunk at a time, the norms too
    largest, op = result["vocabulary"]
    assert 0 < largest <= LOGIT_CHUNK, (largest, op)
