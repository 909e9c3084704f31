"""What only CUDA can show: a learner rank in bf16 on one GPU, and the stabilizers on CUDA tensors.

Skipped without a CUDA device (`-m gpu` selects them; conftest skips them on CPU machines). Run them
whenever a GPU is lent: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from algorithms import registry
from algorithms.batch import PolicyBatch
from tests.component.test_learner import _batch_samples, _free_port

pytestmark = pytest.mark.gpu


def _cuda_rank_main(rank: int, stage: int, model_path: str, port: int, out: str) -> None:
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=stage,
        learning_rate=1e-3,
        stabilizer_name="tis_seq",
        stabilizer_config=registry.build("tis_seq").config,
        dtype="bfloat16",
        backend="nccl",
        max_tokens_per_micro_batch=48,
    )  # several micro-batches, padded to equal counts
    learner = LearnerRank(spec, 0, 1, "127.0.0.1", port)
    batch = collate(_batch_samples(), 0)
    sft = learner.sft_step(batch, learning_rate=1e-3)
    before = learner.state_dict_for_publish()
    metrics = learner.train_step(batch)  # a CPU batch: the rank moves it to its device
    after = learner.state_dict_for_publish()
    learner.save_model(out + ".model")
    torch.save(
        {
            "device": str(learner.device),
            "sft": sft,
            "metrics": metrics,
            "changed": sum(not torch.equal(before[n], after[n]) for n in before),
            "published_devices": sorted({str(t.device) for t in after.values()}),
        },
        out,
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_learner_rank_steps_publishes_and_saves_on_one_gpu(tiny_qwen2, tmp_path, stage):
    out = str(tmp_path / f"cuda-z{stage}.pt")
    mp.start_processes(
        _cuda_rank_main, args=(stage, tiny_qwen2, _free_port(), out), nprocs=1, start_method="spawn", join=True
    )
    result = torch.load(out, weights_only=True)
    assert result["device"].startswith("cuda")
    assert result["metrics"]["perf/micro_batches"] > 1 and result["metrics"]["stability/skipped_step"] == 0
    assert all(value == value for value in result["metrics"].values() if isinstance(value, float))  # no NaN
    assert result["changed"] > 0 and result["published_devices"] == ["cpu"]


@pytest.mark.parametrize("name", sorted(registry.STABILIZERS))
def test_each_stabilizer_decides_on_cuda_as_on_cpu(name):
    gen = torch.Generator().manual_seed(0)
    behaviour = -2.0 + torch.randn(16, 32, generator=gen)
    learner = behaviour + 0.3 * torch.randn(16, 32, generator=gen)
    mask = torch.arange(32)[None, :] < torch.randint(1, 33, (16,), generator=gen)[:, None]
    advantages = torch.randn(16, generator=gen)
    stabilizer = registry.build(name)
    on_cpu = stabilizer.token_weights(PolicyBatch(learner * mask, behaviour * mask, advantages, mask))
    on_cuda = stabilizer.token_weights(
        PolicyBatch(*(t.cuda() for t in (learner * mask, behaviour * mask, advantages, mask)))
    )
    assert on_cuda.weights.device.type == "cuda"
    assert torch.allclose(on_cuda.weights.cpu(), on_cpu.weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(on_cuda.mask.cpu().bool(), on_cpu.mask.bool())


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_packed_rows_on_cuda_give_the_padded_rows_logprobs_and_gradients(tiny_qwen2, fused):
    """`rows_sdpa` runs CUDA's SDPA kernels (flash or memory-efficient) on the rows as a padded batch: in fp32 the
    packed forward's log-probs and gradients match the padded one's, and attention across rows is far off."""
    from transformers import AutoModelForCausalLM

    from learner import micro_batches
    from learner.batch import token_logprobs
    from learner.fused_head import fused_head
    from learner.packing import packing_support
    from tests.component.test_packing import _batch, padded_and_packed

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="sdpa").cuda()
    supported, why = packing_support(model)  # routes the model's attention through the packed wrapper
    assert supported, why
    head = fused_head(model)[0] if fused else None
    batch = _batch(model.config.vocab_size).to("cuda")
    (run,) = micro_batches.plan(batch.sequence_lengths, batch.group_ids, None, False, packed=True).micro_batches
    assert run.packing.tokens.device.type == "cuda"
    micro = batch.rows(run.rows).trimmed(run.width)
    mask = micro.loss_mask.bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).cuda() * mask
    results = padded_and_packed(model, head, micro, run.packing, weights)
    (padded_lp, _, padded_g), (packed_lp, _, packed_g) = results["padded"], results["packed"]
    assert packed_lp.device.type == "cuda"
    torch.testing.assert_close(packed_lp[mask], padded_lp[mask], rtol=0, atol=1e-4)
    for (name, _), want, got in zip(model.named_parameters(), padded_g, packed_g):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4, msg=name)
    ids = micro.input_ids.reshape(-1)[run.packing.tokens][None]
    with torch.no_grad():  # one causal sequence over all rows: the check above can fail
        crossing = token_logprobs(model(input_ids=ids, position_ids=run.packing.position_ids).logits, ids, 1.0)
        crossing = crossing[0, run.packing.scored]
        crossing = crossing.new_zeros(mask.numel()).index_put((run.packing.targets_at,), crossing).view(mask.shape)
    assert (crossing - padded_lp)[mask].abs().max() > 1e-2


def test_the_varlen_kernel_gives_each_rows_own_causal_attention_in_bf16():
    """On CUDA in bf16 a packed forward's attention is one varlen flash call (grouped-query heads as they are);
    it matches SDPA's causal kernel on the rows as a padded batch, in values and gradients."""
    from learner.micro_batches import Packing
    from learner.packing import rows_sdpa, varlen_sdpa

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = (1, 90, 4, 33, 200, 12)
    n, heads, kv_heads, head_dim = sum(lengths), 8, 2, 64

    def drawn(h):
        return torch.randn(1, h, n, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()

    query, key, value = drawn(heads), drawn(kv_heads), drawn(kv_heads)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    rows = Packing.of(list(lengths), max(lengths), torch.device("cuda"))
    outputs = {}
    for name, attend in (
        ("varlen", lambda: varlen_sdpa(query, key, value, cu_seqlens, max(lengths), None)),
        (
            "rows",
            lambda: rows_sdpa(module, query, key, value, rows.row_spans, rows.row_places, max(lengths), 0.0, None),
        ),
    ):
        output = attend()
        assert output is not None and output.shape == (1, n, heads, head_dim)
        grads = torch.autograd.grad(output.float().square().sum(), (query, key, value))
        outputs[name] = (output.float(), [g.float() for g in grads])
    torch.testing.assert_close(outputs["varlen"][0], outputs["rows"][0], rtol=0, atol=2e-2)
    for want, got in zip(outputs["rows"][1], outputs["varlen"][1]):
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert varlen_sdpa(query.float(), key.float(), value.float(), cu_seqlens, max(lengths), None) is None  # fp32


def test_inductor_compiled_layers_on_cuda_give_the_eager_logprobs_and_gradients(tiny_qwen2):
    """`learner.compile: layers` as a GPU runs it: inductor's Triton kernels for each decoder layer, the packed
    attention between two graphs, one compile for micro-batches of every length."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from learner.compiled_layers import compile_decoder_layers
    from learner.packing import packing_support
    from tests.component.test_compiled_layers import compiled_matches_eager

    eager, compiled = (
        AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="sdpa").cuda()
        for _ in range(2)
    )
    for model in (eager, compiled):
        assert packing_support(model)[0]
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(compiled, "inductor", rank=0) > 1
    compiled_matches_eager(eager, compiled, "cuda", 1e-4)
