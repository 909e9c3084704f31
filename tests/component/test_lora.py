"""LoRA (`model.lora`) on the tiny model: the learner trains and publishes the adapter alone, on real DeepSpeed
(gloo), and the vLLM generator samples with each version's adapter."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from learner.lora import ADAPTER_FOLDER, LoraSpec
from tests.component.test_learner import ADAM_EPS, LEARNING_RATE, _batch_samples, _free_port, _leave_group

LORA = LoraSpec(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))


def _rank_main(
    rank: int,
    world: int,
    model_path: str,
    port: int,
    out: str,
    stabilizer: tuple[str, dict],
    options: dict,
    folder: str,
) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    name, config = stabilizer
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name=name,
        stabilizer_config=registry.build(name, **config).config,
        loss_aggregation="token-mean",
        lora=LORA,
        **options,
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    before = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    share = [s for s in _batch_samples() if s["group_id"] % world == rank]
    metrics = [learner.train_step(collate(share, 0)) for _ in range(2)]
    after = dict(learner.engine.module.named_parameters())
    moved = sorted(n for n, p in before.items() if not torch.equal(p, after[n].detach()))
    published = learner.state_dict_for_publish()
    if folder:
        learner.save_model(folder)
    if rank == 0:
        trainable = sorted(n for n, p in after.items() if p.requires_grad)
        torch.save({"metrics": metrics, "moved": moved, "trainable": trainable, "published": published}, out)
    _leave_group()


def _run(world: int, model_path: str, out, stabilizer=("tis_seq", {"cap": 2.0}), options=None, folder="") -> dict:
    mp.start_processes(
        _rank_main,
        args=(world, model_path, _free_port(), str(out), stabilizer, options or {}, folder),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=True)


# 50 s. The default suite's LoRA job test shows the same end to end: its saved model is the base plus the adapter
@pytest.mark.slow
def test_the_learner_trains_and_publishes_only_the_adapter(tiny_qwen2, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = _run(1, tiny_qwen2, tmp_path / "lora.pt", folder=str(tmp_path / "model"))
    assert run["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in run["trainable"])
    assert run["moved"] == run["trainable"]  # every adapter weight trained, no base weight moved
    full = load_file(f"{tiny_qwen2}/model.safetensors")
    published = run["published"]
    assert set(published) == {n.replace(".default", "") for n in run["trainable"]}  # peft's saved names
    assert sum(t.numel() for t in published.values()) < 0.2 * sum(t.numel() for t in full.values())

    # the saved model is the merged policy, with the adapter alone beside it: both give the same logits
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32), str(tmp_path / "model" / ADAPTER_FOLDER)
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    with torch.no_grad():
        merged_logits, adapted_logits, base_logits = (m(ids).logits for m in (merged, adapted, base))
    assert torch.allclose(merged_logits, adapted_logits, atol=1e-4)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-4)  # it trained


@pytest.mark.slow  # 80 s: two runs; the default suite keeps the job test, whose KL reference is the base too
def test_vcpo_norms_cover_the_adapter_only_and_the_kl_reference_is_the_base(tiny_qwen2, tmp_path):
    vcpo = lambda impl: ("vcpo", {"opob_impl": impl})  # noqa: E731
    options = {"kl_coef": 0.1, "kl_estimator": "k3"}
    ghost = _run(1, tiny_qwen2, tmp_path / "ghost.pt", vcpo("ghost"), options)
    loop = _run(1, tiny_qwen2, tmp_path / "loop.pt", vcpo("per_sample_loop"), options)
    assert ghost["metrics"][0]["opob/fallback_to_loop"] == 0
    for key in ("opob/sample_grad_norm_mean", "opob/sample_grad_norm_max", "opob/baseline_mean"):
        assert ghost["metrics"][0][key] == pytest.approx(loop["metrics"][0][key], rel=1e-4), key
    for name, tensor in loop["published"].items():
        assert torch.allclose(ghost["published"][name], tensor, atol=1e-5), name
    # the reference is the base model (the adapter switched off): the KL starts at 0 and moves once B trains
    kl = [m["stability/kl_ref_mean"] for m in ghost["metrics"]]
    assert kl[0] == 0.0 < kl[1]


def _adapter(model_path: str, scale: float) -> tuple[dict[str, torch.Tensor], object]:
    """A LoRA adapter of the tiny model whose B matrices are random times `scale` (0: the base model)."""
    from transformers import AutoModelForCausalLM

    from learner.lora import adapter_weights, with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), LORA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    return {name: tensor.detach().clone() for name, tensor in adapter_weights(model).items()}, model


def test_the_generator_samples_with_each_versions_adapter(tiny_qwen2):
    pytest.importorskip("vllm")
    from actors.generator import Generator, GeneratorSpec
    from learner.batch import collate, token_logprobs
    from learner.weight_sync import PackedWeights
    from tests.component.test_generator import _requests

    generator = Generator(
        GeneratorSpec(
            model_path=tiny_qwen2,
            samples_per_prompt=2,
            max_new_tokens=12,
            temperature=0.7,
            max_model_len=128,
            lora=LORA,
        )
    )
    tokens = lambda groups: [c["completion_ids"] for g in groups for c in g.completions]  # noqa: E731
    before = generator.generate(_requests())
    tensors, adapted = _adapter(tiny_qwen2, scale=0.5)
    generator.update_weights(PackedWeights.pack(tensors), version=1)
    changed = generator.generate(_requests())
    assert changed[0].version_start == 1 and tokens(changed) != tokens(before)

    # the adapter vLLM samples with is the learner's: the log-probs agree on its samples
    samples = [
        dict(
            prompt_ids=g.prompt_ids,
            completion_ids=c["completion_ids"],
            reward=0.0,
            group_id=g.group_id,
            behaviour_logprobs=c["behaviour_logprobs"],
            version=1,
        )
        for g in changed
        for c in g.completions
    ]
    batch = collate(samples, pad_token_id=0)
    with torch.no_grad():
        logits = adapted(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    diff = (token_logprobs(logits, batch.input_ids, temperature=0.7) - batch.behaviour_logprobs)[batch.loss_mask]
    assert diff.abs().max().item() < 1e-3, f"max |generator - learner| = {diff.abs().max().item():.2e}"

    zeros, _ = _adapter(tiny_qwen2, scale=0.0)  # B = 0: the base model again
    generator.update_weights(PackedWeights.pack(zeros), version=2)
    assert tokens(generator.generate(_requests())) == tokens(before)
    assert generator.llm.llm_engine.list_loras() == {3}  # the earlier versions' adapters were removed
