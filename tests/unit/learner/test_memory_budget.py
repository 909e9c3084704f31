"""The micro-batch memory model and the budget it gives (`learner.max_tokens_per_micro_batch: auto`), without a
model: plain numbers and config-like objects."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from learner.memory_budget import (
    MicroBatchBudgetTooSmall,
    ModelShape,
    StepMemory,
    choose_budget,
    host_available_bytes,
    kept_gradient_cap,
    step_memory,
)

# SmolLM2-135M's shape
SMOLLM2 = ModelShape(hidden=576, intermediate=1536, layers=30, query_width=576, key_value_width=192, vocab=49152)
PARAMETERS = 134_515_008
GIB = 2**30


def _per_token(
    shape: ModelShape = SMOLLM2, dtype_bytes: int = 4, checkpointing: bool = False, norms: bool = False
) -> int:
    return step_memory(
        shape, dtype_bytes, PARAMETERS, 512, gradient_checkpointing=checkpointing, per_sample_norms=norms
    ).bytes_per_token


def test_the_shape_comes_from_a_config_with_grouped_query_attention_and_an_implicit_head_dim():
    config = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    )
    assert ModelShape.from_config(config) == SMOLLM2
    no_gqa = SimpleNamespace(**{**vars(config), "num_key_value_heads": None, "head_dim": 32})
    assert ModelShape.from_config(no_gqa).key_value_width == 9 * 32 == ModelShape.from_config(no_gqa).query_width


def test_a_multimodal_config_is_measured_by_its_text_part():
    text = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    )
    assert ModelShape.from_config(SimpleNamespace(get_text_config=lambda: text)) == SMOLLM2


@pytest.mark.parametrize("field", ["vocab", "hidden", "layers", "intermediate", "query_width", "key_value_width"])
def test_bytes_per_token_grow_with_every_dimension_of_the_model(field):
    bigger = replace(SMOLLM2, **{field: 2 * getattr(SMOLLM2, field)})
    assert _per_token(bigger) > _per_token()
    assert _per_token(bigger, checkpointing=True) > _per_token(checkpointing=True) or field == "layers"


def test_more_layers_cost_little_per_token_with_checkpointing_and_much_without():
    deeper = replace(SMOLLM2, layers=60)
    with_checkpointing = _per_token(deeper, checkpointing=True) - _per_token(checkpointing=True)
    without = _per_token(deeper) - _per_token()
    assert 0 < with_checkpointing == 4 * 30 * SMOLLM2.hidden < without / 10


def test_checkpointing_lowers_and_a_half_precision_model_halves_the_activations():
    assert _per_token(checkpointing=True) < _per_token() / 3
    assert _per_token(dtype_bytes=2) == pytest.approx(_per_token() / 2, rel=0.01)


def test_per_sample_norms_raise_the_cost_by_an_fp32_logits_gradient():
    assert _per_token(norms=True) - _per_token() >= 4 * SMOLLM2.vocab


def test_book_keeping_within_its_budget_costs_at_most_the_budget_and_forced_grows_without_bound():
    def memory(cap: float) -> StepMemory:
        return step_memory(
            SMOLLM2,
            4,
            PARAMETERS,
            512,
            gradient_checkpointing=False,
            per_sample_norms=True,
            kept_gradient_cap_bytes=cap,
        )

    ghost, budgeted, forced = memory(0.0), memory(GIB), memory(math.inf)
    for tokens in (1, 512, 8192, 100_000):
        assert ghost.bytes_for(tokens) < budgeted.bytes_for(tokens) <= ghost.bytes_for(tokens) + GIB
    assert budgeted.bytes_for(100_000) - ghost.bytes_for(100_000) == GIB  # the kept gradients reached the budget
    growth = {
        name: memory.bytes_for(200_000) - memory.bytes_for(100_000)
        for name, memory in (("ghost", ghost), ("budgeted", budgeted), ("forced", forced))
    }
    assert growth["budgeted"] == growth["ghost"] < growth["forced"]  # forced: kept gradients in every token
    assert forced.fixed_bytes == ghost.fixed_bytes + 4 * PARAMETERS  # and the score buffer


def test_capped_temporaries_stop_growing():
    memory = StepMemory(bytes_per_token=100, fixed_bytes=1000, capped=((10, 500.0),))
    assert memory.bytes_for(0) == 1000
    assert memory.bytes_for(20) == 1000 + 2000 + 200
    assert memory.bytes_for(1000) == 1000 + 100_000 + 500


def test_the_budget_is_the_most_tokens_that_fit_the_usable_share():
    memory = StepMemory(bytes_per_token=1000, fixed_bytes=100_000, capped=((100, 50_000.0),))
    budget = choose_budget(
        memory, free_bytes=2_000_000, usable_share=0.5, sequence_tokens=128, gradient_checkpointing=False
    )
    assert memory.bytes_for(budget.tokens) <= 1_000_000 < memory.bytes_for(budget.tokens + 1)
    assert budget.tokens == 850  # (1e6 - 1e5 - 5e4) / 1000: the temporaries are at their cap
    assert budget.why.startswith("850 tokens per micro-batch (learner.max_tokens_per_micro_batch auto): 50% of ")
    more = choose_budget(
        memory, free_bytes=4_000_000, usable_share=0.5, sequence_tokens=128, gradient_checkpointing=False
    )
    assert more.tokens == 1850


def test_smollm2_on_this_machine_gets_a_budget_that_holds_several_sequences():
    """The issue's job: 20 GiB free on the 24 GiB machine, VCPO under auto, rows of up to 512 tokens."""
    memory = step_memory(
        SMOLLM2, 4, PARAMETERS, 512, gradient_checkpointing=False, per_sample_norms=True, kept_gradient_cap_bytes=GIB
    )
    budget = choose_budget(
        memory, free_bytes=20 * GIB, usable_share=0.5, sequence_tokens=512, gradient_checkpointing=False
    )
    assert 2 * 512 <= budget.tokens < 8192, budget.why


def test_an_auto_book_keeping_budget_takes_half_the_room_and_no_more_than_a_fixed_micro_batch_leaves():
    """bookkeeping_budget_mb auto on the issue's job (20 GiB free, VCPO, fp32 SmolLM2): half of what a step
    may use beyond its fixed bytes, and the token budget chosen with it still holds several sequences."""
    without_kept = step_memory(
        SMOLLM2, 4, PARAMETERS, 512, gradient_checkpointing=False, per_sample_norms=True, later_bytes=8 * PARAMETERS
    )
    usable = 0.5 * 20 * GIB
    cap = kept_gradient_cap(without_kept, usable, None)
    assert cap == 0.5 * (usable - without_kept.fixed_bytes)
    with_kept = step_memory(
        SMOLLM2,
        4,
        PARAMETERS,
        512,
        gradient_checkpointing=False,
        per_sample_norms=True,
        kept_gradient_cap_bytes=cap,
        later_bytes=8 * PARAMETERS,
    )
    budget = choose_budget(
        with_kept, free_bytes=20 * GIB, usable_share=0.5, sequence_tokens=512, gradient_checkpointing=False
    )
    assert budget.tokens >= 2 * 512, budget.why
    # a fixed micro-batch of 2048 tokens leaves usable - its bytes, less than half the room here
    fixed_tokens = kept_gradient_cap(without_kept, usable, 2048)
    assert fixed_tokens == usable - without_kept.bytes_for(2048) < cap
    assert kept_gradient_cap(without_kept, usable, 100_000) == 0.0  # a micro-batch that fills the memory: none


def test_not_even_one_sequence_is_an_error_naming_both_knobs_and_the_numbers():
    memory = step_memory(SMOLLM2, 4, PARAMETERS, 4096, gradient_checkpointing=False, per_sample_norms=False)
    with pytest.raises(MicroBatchBudgetTooSmall) as info:
        choose_budget(memory, free_bytes=10 * GIB, usable_share=0.5, sequence_tokens=4096, gradient_checkpointing=False)
    message = str(info.value)
    assert "learner.max_tokens_per_micro_batch" in message and "learner.gradient_checkpointing: true" in message
    assert "one sequence of 4096 tokens (generator.max_model_len)" in message
    assert "50% of the 10.00 GiB free on the rank's device is 5.00 GiB" in message
    assert f"{memory.bytes_for(4096) / GIB:.2f} GiB" in message
    checkpointed = step_memory(SMOLLM2, 4, PARAMETERS, 4096, gradient_checkpointing=True, per_sample_norms=False)
    assert (
        choose_budget(
            checkpointed, free_bytes=10 * GIB, usable_share=0.5, sequence_tokens=4096, gradient_checkpointing=True
        ).tokens
        >= 4096
    )


def test_with_checkpointing_already_on_the_error_does_not_suggest_it():
    memory = StepMemory(bytes_per_token=10**6, fixed_bytes=0)
    with pytest.raises(MicroBatchBudgetTooSmall) as info:
        choose_budget(memory, free_bytes=10**8, usable_share=0.5, sequence_tokens=100, gradient_checkpointing=True)
    assert "gradient_checkpointing" not in str(info.value)
    assert "learner.max_tokens_per_micro_batch" in str(info.value)


MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


@pytest.mark.parametrize(
    "limit, usage, expected_kib",
    [
        (None, None, 20_000_000),  # no cgroup files
        ("max\n", "123\n", 20_000_000),  # cgroup v2 without a limit
        ("9223372036854771712\n", "5000\n", 20_000_000),  # v1's "no limit"
        (f"{8 * 2**30}\n", f"{2 * 2**30}\n", 6 * 2**20),  # a limit that leaves less than the host
        (f"{100 * 2**30}\n", f"{2 * 2**30}\n", 20_000_000),  # a limit above what the host has
    ],
)
def test_host_memory_is_mem_available_or_less_under_a_cgroup_limit(limit, usage, expected_kib):
    assert host_available_bytes(MEMINFO, limit, usage) == expected_kib * 1024


def test_memory_the_rank_takes_later_counts_as_fixed():
    """AdamW's moments appear at the first step, a KL reference copy after the budget is chosen."""
    now = step_memory(SMOLLM2, 4, PARAMETERS, 512, gradient_checkpointing=False, per_sample_norms=False)
    later = step_memory(
        SMOLLM2, 4, PARAMETERS, 512, gradient_checkpointing=False, per_sample_norms=False, later_bytes=8 * PARAMETERS
    )
    assert later.fixed_bytes - now.fixed_bytes == 8 * PARAMETERS
    assert later.bytes_per_token == now.bytes_per_token


def test_a_gpu_rank_plans_on_its_share_of_the_gpu_and_a_host_rank_on_its_share_of_the_host(monkeypatch):
    import torch

    from learner import memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * GIB)
    gpu = SimpleNamespace(type="cuda")
    assert memory_budget.read_free_bytes(gpu, 1, 1.0) == (72 * GIB, memory_budget.USABLE_SHARE_CUDA)
    assert memory_budget.read_free_bytes(gpu, 1, 0.5) == (40 * GIB, memory_budget.USABLE_SHARE_CUDA)
    monkeypatch.setattr(memory_budget, "read_host_available_bytes", lambda: 20 * GIB)
    assert memory_budget.read_free_bytes(SimpleNamespace(type="cpu"), 4, 1.0) == (
        5 * GIB,
        memory_budget.USABLE_SHARE_HOST,
    )


@pytest.mark.parametrize("norms", [False, True])
def test_a_fused_output_layer_costs_no_tokens_by_vocabulary_bytes(norms):
    """Where the output layer fuses with the log-softmax the logits (and VCPO's logits gradient, and book-keeping's
    factors of it) exist one chunk at a time: per token a few hidden-state vectors remain, so the same memory
    holds more tokens (SmolLM2's 49k vocabulary was most of a token's bytes beside its activations)."""
    whole = step_memory(SMOLLM2, 2, PARAMETERS, 512, gradient_checkpointing=True, per_sample_norms=norms)
    fused = step_memory(
        SMOLLM2, 2, PARAMETERS, 512, gradient_checkpointing=True, per_sample_norms=norms, fused_head=True
    )
    vocab, hidden = SMOLLM2.vocab, SMOLLM2.hidden
    logits_bytes = 2 * 2 * vocab + (4 * (vocab + hidden) if norms else 0)  # bf16 logits and gradient, fp32 one
    hidden_bytes = 2 * hidden + ((4 + 2) * hidden if norms else 0)  # the gradient at h; the norms' start, laid h
    assert whole.bytes_per_token - fused.bytes_per_token == logits_bytes - hidden_bytes
    assert fused.bytes_per_token < whole.bytes_per_token / 2  # with checkpointing, the logits dominated
    assert fused.capped[0] == whole.capped[0]  # the chunked log-softmax's temporaries stay
    if norms:
        kept = step_memory(
            SMOLLM2,
            2,
            PARAMETERS,
            512,
            gradient_checkpointing=True,
            per_sample_norms=True,
            kept_gradient_cap_bytes=GIB,
            fused_head=True,
        )
        unfused = step_memory(
            SMOLLM2, 2, PARAMETERS, 512, gradient_checkpointing=True, per_sample_norms=True, kept_gradient_cap_bytes=GIB
        )
        assert unfused.capped[-1][0] - kept.capped[-1][0] == 4 * SMOLLM2.vocab  # the head keeps its input only
    budget = choose_budget(fused, 20 * GIB, 0.5, 512, gradient_checkpointing=True).tokens
    assert budget is not None and budget > choose_budget(whole, 20 * GIB, 0.5, 512, gradient_checkpointing=True).tokens


def test_book_keeping_may_keep_what_a_micro_batch_leaves_within_its_share():
    """bookkeeping_budget_mb auto: a micro-batch smaller than the token budget leaves room that a full one would
    take, up to the share's bound; a number of MiB holds whatever the micro-batch's size."""
    from learner.memory_budget import KeptGradientBudget

    memory = step_memory(SMOLLM2, 4, PARAMETERS, 512, gradient_checkpointing=False, per_sample_norms=True)
    usable = 12 * GIB
    most = kept_gradient_cap(memory, usable, None)
    kept = KeptGradientBudget(most, usable, memory)
    full = 4000  # tokens whose micro-batch leaves less than the share's bound
    assert 0 < usable - memory.bytes_for(full) < most
    assert kept.bytes_for(full) == usable - memory.bytes_for(full) == kept_gradient_cap(memory, usable, full)
    assert kept.bytes_for(1000) == most > kept.bytes_for(full)  # a small micro-batch: the share's bound
    assert kept.bytes_for(100_000) == 0.0  # one that fills the memory keeps nothing
    assert KeptGradientBudget(GIB).bytes_for(1000) == KeptGradientBudget(GIB).bytes_for(100_000) == GIB
