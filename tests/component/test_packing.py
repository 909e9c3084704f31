"""Packed micro-batches (learner/packing.py) give the padded rows' log-probs, entropy and gradients.

A micro-batch's rows of very different lengths run as one sequence without padding, position ids restarting
per row and attention kept within each row; in fp32 every real position's log-prob and every parameter's
gradient equal the padded forward's within 1e-5. The learner's step and SFT step with packing give the
padded step's update.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _free_port, _leave_group

TOLERANCE = 1e-5
COMPLETION_LENGTHS = (1, 90, 4, 33, 200, 12)  # a 1-token answer beside 200 tokens


def _batch(vocab: int):
    from learner.batch import collate

    gen = torch.Generator().manual_seed(0)
    samples = []
    for row, length in enumerate(COMPLETION_LENGTHS):
        samples.append(
            dict(
                prompt_ids=torch.randint(3, vocab, (3 + 2 * row,), generator=gen).tolist(),
                completion_ids=torch.randint(3, vocab, (length,), generator=gen).tolist(),
                behaviour_logprobs=[-1.0] * length,
                reward=0.0,
                group_id=0,
                version=0,
            )
        )
    return collate(samples, 0)


def _padded(model, head, micro, with_entropy: bool):
    """The learner's padded path: right-padded rows without a padding mask."""
    from learner.batch import token_logprobs_and_entropy
    from learner.step import causal_logits

    if head is not None:
        return head.token_logprobs(micro.input_ids, 1.0, with_entropy)
    return token_logprobs_and_entropy(causal_logits(model, micro), micro.input_ids, 1.0)


def padded_and_packed(model, head, micro, packing, weights) -> dict[str, tuple]:
    """Log-probs, entropy and every parameter's gradient of a weighted sum of both, from the padded forward
    and from the packed one of the same micro-batch."""
    from learner.packing import packed_token_logprobs

    results = {}
    for name, forward in (
        ("padded", lambda: _padded(model, head, micro, True)),
        ("packed", lambda: packed_token_logprobs(model, head, micro, packing, 1.0, True)),
    ):
        model.zero_grad()
        logprobs, entropy = forward()
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        results[name] = (logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()])
    return results


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_packed_and_padded_logprobs_and_gradients_agree_in_fp32(fixture, fused, request):
    from transformers import AutoModelForCausalLM

    from learner import micro_batches
    from learner.fused_head import fused_head
    from learner.packing import packing_support

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), dtype=torch.float32)
    supported, why = packing_support(model)
    assert supported, why
    head = fused_head(model)[0] if fused else None
    assert (head is not None) == fused
    batch = _batch(model.config.vocab_size)
    (run,) = micro_batches.plan(batch.sequence_lengths, batch.group_ids, None, False, packed=True).micro_batches
    micro = batch.rows(run.rows).trimmed(run.width)
    mask = micro.loss_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask

    results = padded_and_packed(model, head, micro, run.packing, weights)
    (padded_lp, padded_h, padded_g), (packed_lp, packed_h, packed_g) = results["padded"], results["packed"]
    torch.testing.assert_close(packed_lp[mask], padded_lp[mask], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(packed_h[mask], padded_h[mask], rtol=0, atol=TOLERANCE)
    for (name, _), want, got in zip(model.named_parameters(), padded_g, packed_g):
        assert want.abs().max() > 0, name  # every parameter takes part
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE, msg=name)

    # the check can fail: the same packed sequence with attention across rows (one causal sequence) is far off
    ids = micro.input_ids.reshape(-1)[run.packing.tokens][None]
    with torch.no_grad():
        from learner.batch import token_logprobs

        crossing = token_logprobs(
            model(input_ids=ids, position_ids=run.packing.position_ids, use_cache=True).logits, ids, 1.0
        )[0, run.packing.scored]
        crossing = crossing.new_zeros(mask.numel()).index_put((run.packing.targets_at,), crossing).view(mask.shape)
    assert (crossing - padded_lp)[mask].abs().max() > 1e-2


def test_a_model_without_a_varlen_attention_keeps_padded_rows(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    from learner.packing import packing_support

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="eager")
    supported, why = packing_support(model)
    assert not supported and "eager" in why


def test_a_packed_forward_of_a_model_whose_attention_was_not_switched_is_refused(tiny_qwen2):
    """Its own SDPA would take the placeholder mask as attend-everywhere: each row's log-probs would depend on
    the other rows. The error names what switches it."""
    from transformers import AutoModelForCausalLM

    from learner.micro_batches import Packing
    from learner.packing import UnpackedAttention, packed_logits, packing_support

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    micro = _batch(model.config.vocab_size)
    packing = Packing.of(micro.attention_mask.sum(1).tolist(), micro.input_ids.shape[1], torch.device("cpu"))
    with pytest.raises(UnpackedAttention, match="packing_support"):
        packed_logits(model, micro, packing)
    assert packing_support(model)[0]
    assert packed_logits(model, micro, packing).shape[1] == sum(packing.lengths)


CASES = {  # label -> LearnerSpec options (and the stabilizer's config): one pass with a reference and an entropy
    # bonus, two passes, decoupled; VCPO's norms by ghost (a second backward), book-keeping (groups split over
    # padded micro-batches carried in the score buffer) and ZeRO-3's norms forward of its own
    "tis_seq-kl-entropy": dict(stabilizer_name="tis_seq", kl_coef=0.05, entropy_coef=0.01),
    "m2po": dict(stabilizer_name="m2po"),
    "tis_seq-recompute": dict(stabilizer_name="tis_seq", proximal="recompute", mini_batches=2),
    "vcpo-ghost": dict(stabilizer_name="vcpo", config=dict(opob_impl="ghost")),
    "vcpo-bookkeeping": dict(stabilizer_name="vcpo", config=dict(opob_impl="bookkeeping")),
    "vcpo-zero3": dict(stabilizer_name="vcpo", zero_stage=3, config=dict(opob_impl="ghost")),
}
BUDGET = 160  # real tokens: a few packed micro-batches, and more padded ones


def _varied_samples() -> list[dict]:
    """4 prompt groups of 4 responses from 2 to 60 tokens."""
    gen = torch.Generator().manual_seed(0)
    lengths = [2, 60, 7, 25, 40, 3, 13, 55, 9, 31, 2, 18, 47, 5, 22, 11]
    samples = []
    for row, length in enumerate(lengths):
        group, k = divmod(row, 4)
        completion = torch.randint(3, 200, (length,), generator=gen).tolist()
        samples.append(
            dict(
                prompt_ids=torch.randint(3, 200, (5 + group,), generator=gen).tolist(),
                completion_ids=completion,
                behaviour_logprobs=(-5.0 + torch.randn(length, generator=gen)).tolist(),
                reward=float((k + group) % 3 == 0),
                group_id=group,
                version=0,
            )
        )
    return samples


def _learner_main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec
    from learner.vcpo import ghost_norms

    # a row bucket's fixed cost nil: VCPO's norms split packed rows into as many buckets as their Gram cost
    # asks (the tiny model's products are so small that its buckets would cost more than they save)
    ghost_norms.OPERATION_SECONDS["cpu"] = 0.0
    batch = collate(_varied_samples(), 0)
    results = {}
    for packed in (True, False):  # the supervised warm-up; first: a ZeRO-3 rank (last) leaves its
        # partitioning of new models on in this process
        spec = LearnerSpec(
            model_path=model_path,
            learning_rate=LEARNING_RATE,
            adam_eps=ADAM_EPS,
            max_tokens_per_micro_batch=BUDGET,
            packed_micro_batches=packed,
        )
        learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
        metrics = learner.sft_step(batch, LEARNING_RATE)
        results[("sft", packed)] = {"metrics": metrics, "weights": learner.state_dict_for_publish()}
    for label, case in CASES.items():
        for packed in (True, False):
            options = dict(case)
            name, config = options.pop("stabilizer_name"), options.pop("config", {})
            spec = LearnerSpec(
                model_path=model_path,
                learning_rate=LEARNING_RATE,
                adam_eps=ADAM_EPS,
                stabilizer_name=name,
                stabilizer_config=registry.build(name, **config).config,
                max_tokens_per_micro_batch=BUDGET,
                packed_micro_batches=packed,
                **options,
            )
            learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
            metrics = learner.train_step(batch)
            results[(label, packed)] = {"metrics": metrics, "weights": learner.state_dict_for_publish()}
    torch.save(results, out)
    _leave_group()


@pytest.mark.timeout(300)
def test_the_packed_step_gives_the_padded_update(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "packed.pt"
    mp.start_processes(
        _learner_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True
    )
    results = torch.load(out, weights_only=False)
    from learner.micro_batches import row_buckets

    assert len(row_buckets([len(s["prompt_ids"]) + len(s["completion_ids"]) for s in _varied_samples()])) > 1
    initial = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).state_dict()
    failures = []
    for label in [*CASES, "sft"]:
        packed, padded = results[(label, True)], results[(label, False)]
        if label != "sft":
            assert packed["metrics"]["perf/micro_batches"] < padded["metrics"]["perf/micro_batches"], label
        if label == "vcpo-bookkeeping":  # the padded step carried split groups through the score buffer
            assert padded["metrics"]["opob/carried_groups"] > 0 == packed["metrics"]["opob/carried_groups"]
            assert packed["metrics"]["stability/skipped_step"] == 0, label
            assert packed["metrics"]["opob/folded_share"] == padded["metrics"]["opob/folded_share"] == 1.0  # pieces too
        for key, want in padded["metrics"].items():
            if (
                key.startswith("time/")
                or key.startswith("perf/")
                or key in ("opob/carried_groups", "opob/folded_share")
            ):
                continue  # how the step ran: packed micro-batches hold whole groups that padded ones split
            if packed["metrics"][key] != pytest.approx(want, rel=0.0001, abs=1e-06):
                failures.append(f"{label}: {key} {packed['metrics'][key]} != {want}")
        moved = sum(not torch.equal(initial[p], t) for p, t in padded["weights"].items())
        assert moved > 0, f"{label}: the step trained nothing"
        for param, want in padded["weights"].items():
            if not torch.allclose(packed["weights"][param], want, rtol=0, atol=1e-2 * LEARNING_RATE):
                failures.append(
                    f"{label}: weights of {param} differ by {float((packed['weights'][param] - want).abs().max()):.3g}"
                )
    assert not failures, "\n".join(failures)


def test_off_cuda_packed_attention_runs_the_rows_as_one_padded_batch():
    """`varlen_sdpa` serves CUDA in bf16/fp16 only; elsewhere `rows_sdpa` makes one SDPA call for all the rows
    (grouped-query heads), and its outputs and gradients are those of SDPA's causal kernel on each row alone."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from learner.micro_batches import Packing
    from learner.packing import rows_sdpa, varlen_sdpa

    lengths, heads, kv_heads, head_dim = COMPLETION_LENGTHS, 4, 2, 8
    n = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, n, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert varlen_sdpa(query.bfloat16(), key.bfloat16(), value.bfloat16(), cu_seqlens, max(lengths), None) is None
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    packing = Packing.of(list(lengths), max(lengths), torch.device("cpu"))
    calls = []

    class CountAttention(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def row_by_row(q, k, v):
        spans = [slice(start, start + length) for start, length in zip(cu_seqlens[:-1].tolist(), lengths)]
        rows = [
            sdpa_attention_forward(module, q[:, :, s], k[:, :, s], v[:, :, s], None, is_causal=True)[0] for s in spans
        ]
        return torch.cat(rows, dim=1)

    outputs = {}
    for name, attend in (
        (
            "batch",
            lambda q, k, v: rows_sdpa(module, q, k, v, packing.row_spans, packing.row_places, max(lengths), 0.0, None),
        ),
        ("rows", row_by_row),
    ):
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        with CountAttention():
            output = attend(*inputs)
        assert output.shape == (1, n, heads, head_dim)
        outputs[name] = (output, torch.autograd.grad(output.square().sum(), inputs))
    assert calls[0] == calls[-1] and len(calls) == 1 + len(lengths)  # one for the batch, one per row
    torch.testing.assert_close(outputs["batch"][0], outputs["rows"][0], rtol=0, atol=1e-5)
    for got, want in zip(outputs["batch"][1], outputs["rows"][1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
