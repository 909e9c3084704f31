"""`learner.compile: layers`: each decoder layer compiled in place (aot_eager here: traced and differentiated like
inductor, no kernels generated) gives the eager forward's log-probs and gradients, one set of graphs serves every
micro-batch whatever its rows' lengths, and a learner rank's step with compiled layers is the eager step."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _free_port, _leave_group

TOLERANCE = 1e-5


def _micro_batch(vocab: int, completion_lengths: tuple[int, ...], seed: int, device: str = "cpu"):
    """One packed micro-batch of rows of the given completion lengths on `device`, and its packing."""
    from learner import micro_batches
    from learner.batch import collate

    gen = torch.Generator().manual_seed(seed)
    samples = [
        dict(
            prompt_ids=torch.randint(3, vocab, (3 + row,), generator=gen).tolist(),
            completion_ids=torch.randint(3, vocab, (length,), generator=gen).tolist(),
            behaviour_logprobs=[-1.0] * length,
            reward=0.0,
            group_id=0,
            version=0,
        )
        for row, length in enumerate(completion_lengths)
    ]
    batch = collate(samples, 0).to(device)
    (run,) = micro_batches.plan(batch.sequence_lengths, batch.group_ids, None, False, packed=True).micro_batches
    return batch.rows(run.rows).trimmed(run.width), run.packing


def _logprobs_and_gradients(model, micro, packing):
    from learner.packing import packed_token_logprobs

    model.zero_grad()
    logprobs, _ = packed_token_logprobs(model, None, micro, packing, 1.0, False)
    mask = micro.loss_mask
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).to(mask.device) * mask
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])
def test_compiled_layers_give_eager_logprobs_and_gradients_with_one_compile_for_every_length(fixture, request):
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from learner.compiled_layers import compile_decoder_layers, decoder_layers
    from learner.packing import packing_support

    path = request.getfixturevalue(fixture)
    eager, compiled = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for _ in range(2))
    for model in (eager, compiled):
        assert packing_support(model)[0]
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(compiled, "aot_eager", rank=0) == len(decoder_layers(eager)) > 1
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names as before: checkpoints and publishing
    compiled_matches_eager(eager, compiled, "cpu", TOLERANCE)


def compiled_matches_eager(eager, compiled, device: str, tolerance: float) -> None:
    """Micro-batches of different rows' lengths and counts through `eager` and `compiled` (its layers compiled
    since `counters` were cleared): the same log-probs and gradients, and no graph compiled after the first."""
    from torch._dynamo.utils import counters

    graphs_after_first = None
    for seed, lengths in enumerate([(5, 40, 12), (90, 3, 17, 33), (7, 61), (2, 2, 2, 2, 120)]):
        micro, packing = _micro_batch(eager.config.vocab_size, lengths, seed, device)
        want_logprobs, want_grads = _logprobs_and_gradients(eager, micro, packing)
        got_logprobs, got_grads = _logprobs_and_gradients(compiled, micro, packing)
        mask = micro.loss_mask.bool()
        torch.testing.assert_close(got_logprobs[mask], want_logprobs[mask], rtol=0, atol=tolerance)
        for name, want in want_grads.items():
            assert want.abs().max() > 0, name
            torch.testing.assert_close(got_grads[name], want, rtol=tolerance, atol=tolerance, msg=name)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0, "nothing was compiled"
        graphs_after_first = graphs if graphs_after_first is None else graphs_after_first
        assert graphs == graphs_after_first, f"micro-batch {seed} ({lengths}) compiled again: {graphs} graphs"


def test_compiled_layers_are_refused_beside_per_sample_gradient_norms():
    from algorithms import registry
    from algorithms.errors import StableAsyncError
    from learner.compiled_layers import refuse_with_sample_norms

    refuse_with_sample_norms(registry.build("tis_seq"))
    with pytest.raises(StableAsyncError, match=r"learner\.compile: none"):
        refuse_with_sample_norms(registry.build("vcpo"))


def _rank_main(rank: int, model_path: str, port: int, out: str) -> None:
    from learner.batch import collate
    from learner.lora import LoraSpec
    from learner.rank import LearnerRank, LearnerSpec
    from tests.component.test_packing import _varied_samples

    batch = collate(_varied_samples(), 0)
    results = {}
    for label, options in {
        "eager": {},
        "compiled": {"compiled_layers": "aot_eager"},
        "compiled-checkpointed": {"compiled_layers": "aot_eager", "gradient_checkpointing": True},
        "compiled-padded": {"compiled_layers": "aot_eager", "packed_micro_batches": False},
        "lora": {"lora": LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"))},
        "compiled-lora": {
            "compiled_layers": "aot_eager",
            "lora": LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj")),
        },
    }.items():
        spec = LearnerSpec(
            model_path=model_path,
            learning_rate=LEARNING_RATE,
            adam_eps=ADAM_EPS,
            max_tokens_per_micro_batch=256,
            **options,
        )
        learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
        metrics = learner.train_step(batch)
        results[label] = {"metrics": metrics, "weights": learner.state_dict_for_publish()}
    torch.save(results, out)
    _leave_group()


@pytest.mark.timeout(300)
def test_a_rank_with_compiled_layers_takes_the_eager_step(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "compiled.pt"
    mp.start_processes(_rank_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True)
    results = torch.load(out, weights_only=False)
    initial = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).state_dict()
    eager = results["eager"]
    assert eager["metrics"]["perf/micro_batches"] > 1
    assert sum(not torch.equal(initial[name], w) for name, w in eager["weights"].items()) > 0, "nothing trained"
    for label, reference in (
        ("compiled", "eager"),
        ("compiled-checkpointed", "eager"),
        ("compiled-padded", "eager"),
        ("compiled-lora", "lora"),
    ):
        got, want_step = results[label], results[reference]
        assert want_step["metrics"]["optim/grad_norm"] > 0, reference
        assert list(got["weights"]) == list(want_step["weights"]), label
        assert got["metrics"]["optim/grad_norm"] == pytest.approx(want_step["metrics"]["optim/grad_norm"], rel=1e-4)
        for name, want in want_step["weights"].items():
            torch.testing.assert_close(got["weights"][name], want, rtol=0, atol=1e-2 * LEARNING_RATE, msg=label + name)
