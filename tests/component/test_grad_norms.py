"""Ghost per-sample gradient norms against each sample's own backward, on real HF tiny models."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from learner.batch import collate, sequence_logprob_grad, token_logprobs
from learner.vcpo.ghost_norms import GhostGradNorms, UncoveredParameters, per_sample_loop_norms
from learner.vcpo.sample_gradients import SampleGradients


def _samples(pad_id: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(5):
        prompt = torch.randint(3, 200, (4 + i % 3,), generator=gen).tolist()
        completion = torch.randint(3, 200, (2 + i,), generator=gen).tolist()
        if i == 3:
            completion[0] = pad_id  # a pad token inside a sequence: its embedding row gets no gradient
        samples.append(
            dict(
                prompt_ids=prompt,
                completion_ids=completion,
                behaviour_logprobs=[0.0] * len(completion),
                reward=0.0,
                group_id=0,
                version=0,
            )
        )
    return samples


TEMPERATURE = 0.7


def _logits(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def _seq_logp(model, batch):
    return (token_logprobs(_logits(model, batch), batch.input_ids, TEMPERATURE) * batch.loss_mask).sum(1)


def _ghost(model, batch, from_logits=False):
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = _logits(model, batch)
    logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, TEMPERATURE)
    return logits, norms.squared_norms(logits_grad, from_logits=from_logits)


def _alone(model, sample, pad_id) -> float:
    """||grad log pi(tau)||^2 from this sample's own unpadded forward and backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(_seq_logp(model, collate([sample], pad_id))[0], params)
    return float(sum(g.double().square().sum() for g in grads))


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_ghost_norms_equal_each_samples_own_backward(model_name, request):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    pad_id = model.config.pad_token_id
    assert model.model.embed_tokens.padding_idx == pad_id
    samples = _samples(pad_id)
    batch = collate(samples, pad_id)

    _, fast = _ghost(model, batch)
    _, fast_from_logits = _ghost(model, batch, from_logits=True)
    loop = per_sample_loop_norms(
        lambda i: _seq_logp(model, collate([samples[i]], pad_id))[0],
        len(samples),
        [p for p in model.parameters() if p.requires_grad],
    )
    alone = torch.tensor([_alone(model, s, pad_id) for s in samples], dtype=torch.float32)

    assert torch.allclose(fast, alone, rtol=1e-4, atol=0), (fast, alone)
    assert torch.allclose(fast_from_logits, alone, rtol=1e-4, atol=0), (fast_from_logits, alone)
    assert torch.allclose(loop, alone, rtol=1e-4, atol=0), (loop, alone)
    assert len(set(alone.tolist())) == len(samples)  # distinct norms: a mixed-up sample would show


def _kept_bytes(sample_grads: SampleGradients) -> int:
    """What book-keeping kept: every part's factors or dense gradient, in every row bucket."""
    assert sample_grads.parts is not None
    return sum(
        part.numel() * part.element_size()
        if isinstance(part, torch.Tensor)
        else part.left.numel() * part.left.element_size() + part.right.numel() * part.right.element_size()
        for bucket in sample_grads.parts
        for parts in bucket.values()
        for part in parts
    )


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_bookkeeping_forms_any_weighted_sum_of_sample_gradients(model_name, request):
    """One backward gives the norms and, for coefficients chosen afterwards, autograd's gradient of
    sum_i c_i log pi(tau_i) for every parameter (dense, factored and tied-embedding parts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    pad_id = model.config.pad_token_id
    batch = collate(_samples(pad_id), pad_id)
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = _logits(model, batch)
    sample_grads = norms.sample_gradients(sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, TEMPERATURE))
    _, ghost = _ghost(model, batch)
    assert torch.allclose(sample_grads.squared_norms, ghost, rtol=1e-5, atol=0)

    # what opob_impl auto budgets for: the estimate is the memory book-keeping really keeps
    kept = _kept_bytes(sample_grads)
    assert kept == batch.size * norms.kept_bytes_per_sample(batch.input_ids.shape[1])

    coefficients = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.25])
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad((coefficients * _seq_logp(model, batch)).sum(), params)
    formed = sample_grads.weighted_sum(coefficients)
    assert set(map(id, formed)) == set(map(id, params))
    for param, want in zip(params, expected):
        assert torch.allclose(formed[param], want, rtol=1e-4, atol=1e-6 * want.abs().max()), param.shape


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_folded_bookkeeping_forms_the_update_at_baselines_known_only_after_its_norms(model_name, request):
    """Book-keeping that folds: each sample's coefficient is u_i - b_g s_i with u and s known before the norms pass
    and the group baselines b_g after it. The linear weights' per-sample gradients fold into the sums of the basis
    (u, then s within each group) as they come; the update formed from the sums and the kept parts is autograd's
    gradient of sum_i (u_i - b_g s_i) log pi(tau_i), the norms are the ghost path's, and the memory held is what
    the budget counts (`kept_bytes` with the basis's rows)."""
    from transformers import AutoModelForCausalLM

    from learner.vcpo.products import FoldedSums

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    pad_id = model.config.pad_token_id
    gen = torch.Generator().manual_seed(3)
    groups = torch.tensor([0, 0, 1, 1, 1])
    samples = [
        dict(
            prompt_ids=torch.randint(3, 200, (5,), generator=gen).tolist(),
            completion_ids=torch.randint(3, 200, (18 + 3 * i,), generator=gen).tolist(),
            behaviour_logprobs=[0.0] * (18 + 3 * i),
            reward=0.0,
            group_id=int(groups[i]),
            version=0,
        )
        for i in range(5)
    ]
    batch = collate(samples, pad_id)
    u, s = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    basis = torch.stack([u, s * (groups == 0), s * (groups == 1)])
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = _logits(model, batch)
    folds = FoldedSums(basis)
    sample_grads = norms.sample_gradients(
        sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, TEMPERATURE), folds=folds
    )
    _, ghost = _ghost(model, batch)
    assert torch.allclose(sample_grads.squared_norms, ghost, rtol=1e-5, atol=0)
    assert folds.sums and sample_grads.parts is not None and len(sample_grads.parts[0]) > 0  # both kinds taken

    width = batch.input_ids.shape[1]
    held = _kept_bytes(sample_grads) + sum(total.numel() * 4 for total in folds.sums.values())
    assert held == norms.kept_bytes([(batch.size, width)], basis_rows=3)

    baselines = torch.tensor([0.3, -1.2])
    coefficients = u - baselines[groups] * s
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad((coefficients * _seq_logp(model, batch)).sum(), params)
    formed = sample_grads.weighted_sum(coefficients)
    folds.add_into(formed, torch.cat([torch.ones(1), -baselines]))
    assert set(map(id, formed)) == set(map(id, params))
    for param, want in zip(params, expected):
        assert torch.allclose(formed[param], want, rtol=1e-4, atol=1e-6 * want.abs().max()), param.shape


@pytest.mark.parametrize("lengths", [(2, 40, 5, 33, 3, 18, 60, 4), (20,) * 6], ids=["drawn", "equal"])
def test_packed_rows_in_length_buckets_give_the_padded_norms_and_gradients(tiny_qwen2_tied, lengths):
    """A packed forward's norms and book-kept gradients, formed bucket by bucket of rows of similar length,
    equal the padded rows' (the tied output layer's cross term included), and book-keeping keeps what its
    budget check counts: each bucket's rows at the bucket's width, not the longest row's."""
    from transformers import AutoModelForCausalLM

    from learner.micro_batches import Packing
    from learner.packing import packed_ids, packed_logits, packed_loss_mask, packing_support

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_tied, dtype=torch.float32)
    assert packing_support(model)[0]
    pad_id = model.config.pad_token_id
    gen = torch.Generator().manual_seed(2)
    samples = [
        dict(
            prompt_ids=torch.randint(3, 200, (4,), generator=gen).tolist(),
            completion_ids=torch.randint(3, 200, (length,), generator=gen).tolist(),
            behaviour_logprobs=[0.0] * length,
            reward=0.0,
            group_id=0,
            version=0,
        )
        for length in lengths
    ]
    batch = collate(samples, pad_id)
    norms = GhostGradNorms(model)
    real = batch.attention_mask.sum(1).tolist()
    packing = Packing.of(real, batch.input_ids.shape[1], torch.device("cpu"), bucket_cost=0.0)
    equal = len(set(lengths)) == 1  # then one bucket, a view of the packed tensors; else several, copies
    wholes = [bucket.whole for bucket in packing.buckets]
    assert wholes == [True] if equal else (len(wholes) > 1 and not any(wholes))

    with norms.recording():
        logits = packed_logits(model, batch, packing)
    logits_grad = sequence_logprob_grad(
        logits, packed_ids(batch, packing), packed_loss_mask(batch, packing), TEMPERATURE
    )
    sample_grads = norms.sample_gradients(logits_grad, packed=packing)
    _, padded = _ghost(model, batch)
    assert torch.allclose(sample_grads.squared_norms, padded, rtol=1e-4, atol=0), (sample_grads.squared_norms, padded)

    kept = _kept_bytes(sample_grads)
    assert kept == sum(len(b.rows) * norms.kept_bytes_per_sample(b.width) for b in packing.buckets)
    padded_kept = batch.size * norms.kept_bytes_per_sample(batch.input_ids.shape[1])
    assert kept == padded_kept if equal else kept < padded_kept

    coefficients = torch.linspace(-1.0, 2.0, batch.size)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad((coefficients * _seq_logp(model, batch)).sum(), params)
    formed = sample_grads.weighted_sum(coefficients)
    for param, want in zip(params, expected):
        assert torch.allclose(formed[param], want, rtol=1e-4, atol=1e-6 * want.abs().max()), param.shape


class _OperatorCounts(TorchDispatchMode):
    """How many times each aten operator runs (below autograd: what a GPU would launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def test_the_packed_norms_pass_lays_out_and_multiplies_a_shared_input_once_and_adds_each_buckets_norms_once(
    tiny_qwen2_tied, monkeypatch
):
    """On a GPU a small model's norms pass is bound by the host launching kernels: layers that share their
    input (q, k, v; gate, up) lay it out in buckets once and form its Gram once, only output gradients get
    zeros past a row's end, and each bucket's per-row norms reach the micro-batch's in one index_add, not one
    per layer."""
    from transformers import AutoModelForCausalLM

    from learner.micro_batches import Packing, RowBucket
    from learner.packing import packed_ids, packed_logits, packed_loss_mask, packing_support

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_tied, dtype=torch.float32)
    assert packing_support(model)[0]  # attention within each row
    samples = _samples(model.config.pad_token_id)
    batch = collate(samples, model.config.pad_token_id)
    packing = Packing.of(batch.attention_mask.sum(1).tolist(), batch.input_ids.shape[1], torch.device("cpu"), 0.0)
    buckets = len(packing.buckets)
    assert buckets > 1 and not any(bucket.whole for bucket in packing.buckets)
    norms = GhostGradNorms(model)
    inputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, args, _out: inputs.append(args[0])) for m in norms.modules]
    with norms.recording():
        logits = packed_logits(model, batch, packing)
    for hook in hooks:
        hook.remove()
    calls, distinct = len(inputs), len({id(x) for x in inputs})
    assert distinct < calls  # the model has layers that share their input
    unpacked = Counter()
    unpack = RowBucket.unpack

    def counted(bucket, packed, zero_padding=True):
        unpacked[zero_padding] += 1
        return unpack(bucket, packed, zero_padding)

    monkeypatch.setattr(RowBucket, "unpack", counted)
    logits_grad = sequence_logprob_grad(
        logits, packed_ids(batch, packing), packed_loss_mask(batch, packing), TEMPERATURE
    )
    with _OperatorCounts() as operators:
        squared = norms.squared_norms(logits_grad, packed=packing)
    assert unpacked == {True: buckets * calls, False: buckets * distinct}, (unpacked, calls, distinct)
    assert operators.counts[torch.ops.aten.index_add_] == buckets
    # each layer's q, k and v, and its gate and up, add their output gradients' Grams into one (the first of
    # a group forms it): the input's Gram is formed once per group
    layers = model.config.num_hidden_layers
    assert operators.counts[torch.ops.aten.baddbmm_] == buckets * layers * (2 + 1), operators.counts
    _, padded = _ghost(model, batch)
    assert torch.allclose(squared, padded, rtol=1e-4, atol=0)


def test_norms_of_a_packing_planned_without_row_buckets_are_refused(tiny_qwen2_tied):
    """A step without per-sample products plans no buckets; norms over it would be zeros, not an error."""
    from transformers import AutoModelForCausalLM

    from learner.micro_batches import Packing
    from learner.packing import packed_ids, packed_logits, packed_loss_mask, packing_support

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_tied, dtype=torch.float32)
    assert packing_support(model)[0]
    batch = collate(_samples(model.config.pad_token_id), model.config.pad_token_id)
    packing = Packing.of(batch.attention_mask.sum(1).tolist(), batch.input_ids.shape[1], torch.device("cpu"))
    assert packing.buckets == ()
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = packed_logits(model, batch, packing)
    logits_grad = sequence_logprob_grad(
        logits, packed_ids(batch, packing), packed_loss_mask(batch, packing), TEMPERATURE
    )
    with pytest.raises(ValueError, match="bucket_cost"):
        norms.squared_norms(logits_grad, packed=packing)


# bf16 keeps 8 bits of mantissa: each product and each term of a norm is rounded by up to 2^-8 of itself. The
# norms' rounding errors are independent across their many terms, so two roundings bound them: 2^-7.
BF16_NORM_RTOL = 2**-7


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_bf16_norms_and_book_kept_gradients_agree_with_each_samples_own_bf16_backward(model_name, request):
    """A bf16 model's norms come from bf16 products (tensor cores on a GPU) and still match the per-sample
    loop, whose gradients autograd forms in bf16 too, to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.bfloat16)
    pad_id = model.config.pad_token_id
    samples = _samples(pad_id)
    batch = collate(samples, pad_id)
    params = [p for p in model.parameters() if p.requires_grad]
    loop = per_sample_loop_norms(lambda i: _seq_logp(model, collate([samples[i]], pad_id))[0], len(samples), params)
    _, ghost = _ghost(model, batch)
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = _logits(model, batch)
    sample_grads = norms.sample_gradients(sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, TEMPERATURE))
    assert ghost.dtype == torch.float32 and len(set(loop.tolist())) == len(samples)
    assert torch.allclose(ghost, loop, rtol=BF16_NORM_RTOL, atol=0), (ghost, loop)
    assert torch.allclose(sample_grads.squared_norms, loop, rtol=BF16_NORM_RTOL, atol=0)

    coefficients = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.25])
    expected = torch.autograd.grad((coefficients * _seq_logp(model, batch)).sum(), params)
    formed = sample_grads.weighted_sum(coefficients)
    for param, want in zip(params, expected):
        assert formed[param].dtype == torch.bfloat16
        error = (formed[param].float() - want.float()).norm() / want.float().norm()
        assert error < 4 * BF16_NORM_RTOL, (param.shape, float(error))  # summed over B*T terms in bf16


@pytest.mark.parametrize("steps, dense", [(8, False), (512, True)])
def test_a_linear_norm_takes_the_route_with_fewer_flops(steps, dense):
    """Dense costs 2 T m n per sample, the two Gram products 2 T^2 (m + n): a short sequence through a
    [64, 48] layer forms its Gram matrices, a long one through the same layer its dense gradient."""
    from learner.vcpo.products import Factors, factor_inner

    gen = torch.Generator().manual_seed(0)
    factors = Factors(torch.randn(2, steps, 64, generator=gen), torch.randn(2, steps, 48, generator=gen))
    assert factors.dense_is_cheaper == dense
    explicit = torch.einsum("bti,btj->bij", factors.left, factors.right).square().sum((1, 2))
    assert torch.allclose(factor_inner(factors, factors), explicit, rtol=1e-4)


def test_ghost_norms_keep_no_gradients_to_form():
    with pytest.raises(RuntimeError, match="norms only"):
        SampleGradients(torch.ones(2)).weighted_sum(torch.ones(2))


def test_the_graph_survives_for_the_loss_backward(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    batch = collate(_samples(model.config.pad_token_id), model.config.pad_token_id)
    logits, _ = _ghost(model, batch)
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


class _WithHead(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(4, 6)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x):
        return self.head(self.body(x))


def test_a_parameter_without_a_rule_is_reported():
    with pytest.raises(UncoveredParameters, match=r"body\.1\.weight"):
        GhostGradNorms(_WithHead(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))))


def test_squared_norms_needs_a_recorded_forward():
    norms = GhostGradNorms(_WithHead(nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match="recording"):
        norms.squared_norms(torch.zeros(2, 3, 6))


def test_logprob_grad_is_the_autograd_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen, requires_grad=True)
    ids = torch.randint(0, 7, (3, 5), generator=gen)
    mask = torch.rand(3, 4, generator=gen) > 0.3
    (token_logprobs(logits, ids, TEMPERATURE) * mask).sum().backward()
    assert torch.allclose(sequence_logprob_grad(logits, ids, mask, TEMPERATURE), logits.grad, atol=1e-6)


def test_bookkeeping_refuses_a_loss_whose_coefficients_differ_within_a_sequence():
    from learner.step import check_one_coefficient_per_sequence, sequence_coefficients

    mask = torch.tensor([[True, True, False], [True, True, True]])
    per_sequence = torch.tensor([[0.5, 0.5, 0.0], [-2.0, -2.0, -2.0]])
    coefficients, gap = sequence_coefficients(per_sequence, mask)
    assert coefficients.tolist() == [0.5, -2.0]
    check_one_coefficient_per_sequence(float(gap))
    per_token = per_sequence.clone()
    per_token[1, 2] = -1.0  # a token-level weight (token TIS, PPO clip): not a weighted sum of sequences
    with pytest.raises(RuntimeError, match="one loss coefficient per sequence"):
        check_one_coefficient_per_sequence(float(sequence_coefficients(per_token, mask)[1]))


@pytest.mark.parametrize("rows", [6, 4000])  # a small table takes the dense route, a large one the Gram route
def test_embedding_norms_agree_on_both_routes(rows):
    from learner.vcpo.products import Factors, factor_inner

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (3, 9), generator=gen)  # repeated ids: their rows add up
    right = torch.randn(3, 9, 5, generator=gen)
    factors = Factors(ids, right, rows)
    assert factors.dense_is_smaller == (rows == 6) and factors.dense_is_cheaper == (rows == 6)
    explicit = torch.zeros(3, rows, 5)
    for b in range(3):
        for t in range(9):
            explicit[b, ids[b, t]] += right[b, t]
    assert torch.allclose(factors.dense(), explicit, atol=1e-6)
    assert torch.allclose(factor_inner(factors, factors), explicit.square().sum((1, 2)), rtol=1e-5)


def test_a_row_bucket_costs_fewer_tokens_squared_against_wider_layers_and_more_on_a_gpu():
    """A bucket's fixed cost is its operations per module; its unit is the Gram products' cost per token^2 of a
    row, which grows with the layers' widths: wide models split packed rows into more buckets, and a GPU,
    where the products are fast and the host launching them is not, into fewer than a CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    def bucket_cost(hidden: int, device: str) -> float:
        config = Qwen2Config(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return GhostGradNorms(model).bucket_cost(torch.device(device))

    assert bucket_cost(512, "cpu") < bucket_cost(64, "cpu")
    assert bucket_cost(64, "cpu") < bucket_cost(64, "cuda")
