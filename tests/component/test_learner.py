"""Learner ranks under DeepSpeed ZeRO-2 and ZeRO-3 with 1 and 2 ranks (gloo): one global update.

Each configuration runs in fresh processes (a process holds one torch.distributed group). Splitting
the same prompt groups over 2 ranks must give the 1-rank loss, global gradient norm and weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from algorithms.config import TISConfig
from learner.ports import listenable_port

LEARNING_RATE = 1e-2
# Adam's first step is lr * g / (|g| + eps): with the default eps (1e-8) a gradient entry of ~1e-8
# flips between ~0 and ~lr on reduction-order noise, so parity is checked where the step is
# Lipschitz in g (|d step / d g| <= lr / eps) and any real difference in g still shows.
ADAM_EPS = 1e-4


def _batch_samples():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for group in range(4):
        for k in range(4):
            prompt = torch.randint(3, 200, (5 + group,), generator=gen).tolist()
            completion = torch.randint(3, 200, (3 + k,), generator=gen).tolist()
            behaviour = (-5.0 + torch.randn(len(completion), generator=gen)).tolist()
            samples.append(
                dict(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    behaviour_logprobs=behaviour,
                    reward=float((k + group) % 3 == 0),
                    group_id=group,
                    version=0,
                )
            )
    return samples


def _rank_main(
    rank: int,
    world: int,
    stage: int,
    model_path: str,
    port: int,
    out: str,
    stabilizer: tuple[str, dict] = ("tis_seq", {"cap": 2.0}),
) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    name, config = stabilizer
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=stage,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name=name,
        stabilizer_config=registry.build(name, **config).config,
        loss_aggregation="token-mean",
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    samples = _batch_samples()
    share = [s for s in samples if s["group_id"] % world == rank]  # whole groups per rank
    metrics = learner.train_step(collate(share, 0))
    weights = learner.state_dict_for_publish()
    learner.save_model(out + ".model")
    learner.save_checkpoint(out + ".checkpoint", "state")
    if rank == 0:
        torch.save(
            {"metrics": metrics, "weights": weights, "model_folder": out + ".model", "checkpoint": out + ".checkpoint"},
            out,
        )
    _leave_group()


def _leave_group() -> None:
    """Both ranks leave the process group together, then the process ends without running interpreter
    teardown: the last call of a rank's main.

    A rank whose results are written can still abort while the interpreter tears down (SIGABRT,
    "terminate called without an active exception": a C++ thread of the distributed stack still joinable
    at exit), which fails the spawn although every step ran. CI saw it once before the barrier was added
    and twice in one run after it (2 ranks, ZeRO-3); `os._exit` skips that teardown.
    """
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    return listenable_port()


def _run(world: int, stage: int, model_path: str, tmp_path: Path, stabilizer: tuple[str, dict] | None = None) -> dict:
    out = tmp_path / f"w{world}-z{stage}-{stabilizer and stabilizer[1].get('opob_impl')}.pt"
    args = (world, stage, model_path, _free_port(), str(out)) + ((stabilizer,) if stabilizer else ())
    mp.start_processes(_rank_main, args=args, nprocs=world, start_method="spawn", join=True)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def results(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("learner")
    return {(w, z): _run(w, z, tiny_qwen2, tmp) for w in (1, 2) for z in (2, 3)}


@pytest.mark.parametrize("world, stage", [(1, 3), (2, 2), (2, 3)])
def test_same_update_for_every_zero_stage_and_rank_count(results, world, stage):
    reference, other = results[(1, 2)], results[(world, stage)]
    for key in ("optim/loss", "optim/grad_norm", "stability/ess_ratio", "stability/kl_k3"):
        assert other["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-4), key
    assert reference["weights"].keys() == other["weights"].keys()
    # Reduction order (stage, rank count) changes g by fp32 rounding; with lr / eps = 100 that moves a
    # weight by ~2e-5 of a step (measured), while a missing or double-counted shard moves whole steps.
    step_tolerance = 1e-4 * LEARNING_RATE
    for name, tensor in reference["weights"].items():
        assert torch.allclose(tensor, other["weights"][name], rtol=0, atol=step_tolerance), name


@pytest.mark.parametrize("world, stage", [(1, 2), (1, 3), (2, 2), (2, 3)])
def test_the_saved_model_folder_holds_the_trained_weights(results, world, stage, tiny_qwen2):
    """What a finished run leaves in RUN_DIR/model: transformers loads it as it is, with the weights the
    generators got after the step (gathered from the shards under ZeRO-3), and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = results[(world, stage)]
    model = AutoModelForCausalLM.from_pretrained(result["model_folder"], dtype=torch.float32)
    saved = model.state_dict()
    assert set(saved) == set(result["weights"])
    for name, tensor in result["weights"].items():
        assert torch.equal(saved[name], tensor), name
    saved_tokenizer = AutoTokenizer.from_pretrained(result["model_folder"])
    assert saved_tokenizer.vocab == AutoTokenizer.from_pretrained(tiny_qwen2).vocab


@pytest.mark.parametrize("world, stage", [(1, 2), (1, 3), (2, 2), (2, 3)])
def test_export_merges_the_checkpoint_shards_into_the_trained_weights(results, world, stage, tiny_qwen2, tmp_path):
    """`stableasync export`'s core, on one process without the ranks: every rank's ZeRO-2 or ZeRO-3 shards
    merged give exactly the weights the generators got after the step."""
    from safetensors.torch import load_file

    from learner.export import save_checkpoint_model

    result = results[(world, stage)]
    save_checkpoint_model(Path(result["checkpoint"]), "state", tiny_qwen2, str(tmp_path / "exported"))
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert set(exported) == set(result["weights"])
    for name, tensor in result["weights"].items():
        assert torch.equal(exported[name], tensor), name


def test_the_step_changed_the_weights(results, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).state_dict()
    after = results[(1, 2)]["weights"]
    assert results[(1, 2)]["metrics"]["optim/grad_norm"] > 0
    assert any(not torch.equal(before[name], after[name]) for name in after)


def _stabilizer_main(rank: int, name: str, config: dict, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    stabilizer = registry.build(name, **config)
    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        stabilizer_name=name,
        stabilizer_config=stabilizer.config,
        loss_aggregation="seq-mean-token-mean",
    )
    learner = LearnerRank(spec, 0, 1, "127.0.0.1", port)
    torch.save(learner.train_step(collate(_batch_samples(), 0)), out)


@pytest.mark.parametrize("name, config", [("vcpo", {"use_baseline": False}), ("m2po", {}), ("bapo", {})])
def test_stabilizers_run_in_the_learner(tiny_qwen2, tmp_path, name, config):
    from algorithms.vcpo import ess_lr_scale

    out = tmp_path / f"{name}.pt"
    mp.start_processes(
        _stabilizer_main,
        args=(name, config, tiny_qwen2, _free_port(), str(out)),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    metrics = torch.load(out, weights_only=True)
    assert all(v == v for v in metrics.values()), metrics  # no NaN
    assert metrics["stability/skipped_step"] == 0 and metrics["optim/grad_norm"] > 0
    if name == "vcpo":  # behaviour log-probs are far off-policy here: the ESS rule shrinks the LR
        assert metrics["stability/lr_scale"] == pytest.approx(ess_lr_scale(metrics["stability/ess_ratio"]), rel=1e-5)
        assert metrics["stability/lr_scale"] < 1.0
    if name == "m2po":
        assert metrics["stability/m2_after"] <= 0.04 + 1e-6


def _vcpo(impl: str) -> tuple[str, dict]:
    return "vcpo", {"use_baseline": True, "opob_impl": impl}


# Book-keeping forms the update itself (ZeRO-1/2); under ZeRO-3 it runs the two-pass ghost path, the same branch
# of learner/vcpo/step.py as asking for the ghost path by name. The slow-marked cases add no code path that the
# default ones leave out (book-keeping on Llama is also checked against autograd in test_grad_norms), so they run
# with -m slow only, to keep the default suite inside its time budget.
@pytest.mark.parametrize(
    "model_name, world, stage, fast_impls",
    [
        ("tiny_qwen2", 1, 2, ("bookkeeping", "ghost")),
        pytest.param("tiny_qwen2", 1, 3, ("ghost",), marks=pytest.mark.slow),
        ("tiny_qwen2", 2, 2, ("bookkeeping", "ghost")),
        pytest.param("tiny_qwen2", 2, 3, ("bookkeeping",), marks=pytest.mark.slow),  # tiny_llama's below
        pytest.param("tiny_llama", 1, 2, ("bookkeeping",), marks=pytest.mark.slow),
        pytest.param("tiny_llama", 2, 2, ("bookkeeping",), marks=pytest.mark.slow),
        ("tiny_llama", 2, 3, ("bookkeeping",)),  # asked for by name under ZeRO-3: the two-pass ghost path
    ],
)
def test_vcpo_fast_norms_give_the_per_sample_loops_update(model_name, world, stage, fast_impls, request, tmp_path):
    model = request.getfixturevalue(model_name)
    loop = _run(world, stage, model, tmp_path, _vcpo("per_sample_loop"))
    for impl in fast_impls:
        fast = _run(world, stage, model, tmp_path, _vcpo(impl))
        assert fast["metrics"]["opob/fallback_to_loop"] == 0
        for key in (
            "opob/sample_grad_norm_mean",
            "opob/sample_grad_norm_max",
            "opob/baseline_mean",
            "opob/baseline_shift_abs",
            "optim/loss",
            "optim/grad_norm",
        ):
            assert fast["metrics"][key] == pytest.approx(loop["metrics"][key], rel=1e-4), (impl, key)
        # the baseline really moved off the group mean, so a wrong norm would change the update
        assert fast["metrics"]["opob/baseline_shift_abs"] > 1e-3
        # Adam's first step is Lipschitz in the gradient with constant lr / eps, so the update difference
        # bounds nothing looser than: the two gradients agree within 1e-4 of the gradient norm.
        update_gap = sum((fast["weights"][n] - loop["weights"][n]).square().sum() for n in fast["weights"]) ** 0.5
        assert update_gap * ADAM_EPS / LEARNING_RATE <= 1e-4 * loop["metrics"]["optim/grad_norm"], impl


def _steps_main(rank: int, world: int, impl: str, model_path: str, port: int, out: str, steps: int = 3) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name="vcpo",
        stabilizer_config=registry.build("vcpo", opob_impl=impl).config,
        loss_aggregation="token-mean",
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    share = collate([s for s in _batch_samples() if s["group_id"] % world == rank], 0)
    grad_norms = [learner.train_step(share)["optim/grad_norm"] for _ in range(steps)]
    weights = learner.state_dict_for_publish()
    if rank == 0:
        torch.save({"grad_norms": grad_norms, "weights": weights}, out)
    _leave_group()


def test_bookkeeping_keeps_matching_ghost_over_several_steps(tiny_qwen2, tmp_path):
    """Book-keeping runs its forward outside the engine and hands DeepSpeed a surrogate backward; over
    several steps on 2 ranks ZeRO's per-step state must still reduce every gradient as the ghost path's
    ordinary loss backward does."""
    runs = {}
    for impl in ("ghost", "bookkeeping"):
        out = tmp_path / f"steps-{impl}.pt"
        mp.start_processes(
            _steps_main, args=(2, impl, tiny_qwen2, _free_port(), str(out)), nprocs=2, start_method="spawn", join=True
        )
        runs[impl] = torch.load(out, weights_only=True)
    ghost, bookkeeping = runs["ghost"], runs["bookkeeping"]
    assert bookkeeping["grad_norms"] == pytest.approx(ghost["grad_norms"], rel=1e-4)
    assert len(set(ghost["grad_norms"])) == 3  # the steps differ: a stale or repeated gradient would show
    for name, tensor in ghost["weights"].items():
        assert torch.allclose(tensor, bookkeeping["weights"][name], rtol=0, atol=1e-4 * LEARNING_RATE), name


def _nonfinite_main(rank: int, model_path: str, port: int, out: str) -> None:
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        stabilizer_name="tis_seq",
        stabilizer_config=TISConfig(cap=2.0),
    )
    learner = LearnerRank(spec, 0, 1, "127.0.0.1", port)
    samples = _batch_samples()
    samples[5]["behaviour_logprobs"][0] = float("nan")  # a corrupt rollout from a generator
    before = learner.state_dict_for_publish()
    metrics = learner.train_step(collate(samples, 0))
    after = learner.state_dict_for_publish()
    torch.save(
        {
            "metrics": metrics,
            "changed": [n for n in before if not torch.equal(before[n], after[n])],
            "version": learner.version,
        },
        out,
    )


def test_a_non_finite_rollout_skips_the_step_and_keeps_the_weights(tiny_qwen2, tmp_path):
    out = tmp_path / "nonfinite.pt"
    mp.start_processes(
        _nonfinite_main, args=(tiny_qwen2, _free_port(), str(out)), nprocs=1, start_method="spawn", join=True
    )
    result = torch.load(out, weights_only=True)
    assert result["metrics"]["stability/skipped_step"] == 1
    assert result["changed"] == [] and result["version"] == 0


def _checkpoint_main(rank: int, world: int, model_path: str, port: int, folder: str, out: str) -> None:
    """Step, checkpoint, step again; then a fresh rank loads the checkpoint and repeats the second step."""
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name="tis_seq",
        stabilizer_config=TISConfig(cap=2.0),
    )
    samples = _batch_samples()
    share = collate([s for s in samples if s["group_id"] % world == rank], 0)
    first = LearnerRank(spec, rank, world, "127.0.0.1", port)
    first.train_step(share)
    first.save_checkpoint(folder, "step-1")
    continued = first.train_step(share)
    weights = first.state_dict_for_publish()
    del first
    resumed = LearnerRank(spec, rank, world, "127.0.0.1", port)
    version = resumed.load_checkpoint(folder, "step-1")
    repeated = resumed.train_step(share)
    resumed_weights = resumed.state_dict_for_publish()
    if rank == 0:
        torch.save(
            {
                "version": version,
                "continued": continued,
                "repeated": repeated,
                "weights": weights,
                "resumed_weights": resumed_weights,
                "resumed_version": resumed.version,
            },
            out,
        )
    _leave_group()


def test_a_checkpoint_resumes_the_same_trajectory(tiny_qwen2, tmp_path):
    """Two ranks: the step after loading equals the step after saving (Adam moments restored too)."""
    out = tmp_path / "checkpoint.pt"
    mp.start_processes(
        _checkpoint_main,
        args=(2, tiny_qwen2, _free_port(), str(tmp_path / "ckpt"), str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["version"] == 1 and result["resumed_version"] == 2
    for key in ("optim/loss", "optim/grad_norm"):
        assert result["repeated"][key] == pytest.approx(result["continued"][key], rel=1e-5), key
    for name, tensor in result["weights"].items():
        assert torch.equal(tensor, result["resumed_weights"][name]), name


def _schedule_main(rank: int, model_path: str, port: int, out: str, warmup_steps: int) -> None:
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        total_steps=8,
        lr_warmup_steps=warmup_steps,
        loss_aggregation="token-mean",
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    before = {name: tensor.clone() for name, tensor in learner.state_dict_for_publish().items()}
    metrics = learner.train_step(collate(_batch_samples(), 0))
    after = learner.state_dict_for_publish()
    torch.save({"lr": metrics["optim/lr"], "delta": {name: after[name] - before[name] for name in before}}, out)


def test_the_warm_up_scales_the_first_update(tiny_qwen2, tmp_path):
    """Adam's first step is lr * g / (|g| + eps), so with the same gradient a warm-up of 4 steps (factor 1/4
    at the first) moves every weight a quarter as far as no warm-up does, and logs that rate."""
    runs = {}
    for warmup in (0, 4):
        out = tmp_path / f"warmup-{warmup}.pt"
        mp.start_processes(
            _schedule_main, args=(tiny_qwen2, _free_port(), str(out), warmup), nprocs=1, start_method="spawn", join=True
        )
        runs[warmup] = torch.load(out, weights_only=True)
    full, ramped = runs[0], runs[4]
    assert full["lr"] == pytest.approx(LEARNING_RATE) and ramped["lr"] == pytest.approx(LEARNING_RATE / 4)
    assert any(delta.abs().max() > 0 for delta in full["delta"].values())
    for name, delta in full["delta"].items():
        torch.testing.assert_close(ramped["delta"][name], delta / 4, rtol=1e-3, atol=1e-7)


def _schedule_after_sft_main(rank: int, model_path: str, port: int, out: str, folder: str) -> None:
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        total_steps=8,
        lr_warmup_steps=4,
        lr_schedule="linear",
        loss_aggregation="token-mean",
    )
    batch = collate(_batch_samples(), 0)
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    for _ in range(3):
        learner.sft_step(batch, learning_rate=1e-4)
    rates = [learner.train_step(batch)["optim/lr"] for _ in range(2)]
    learner.save_checkpoint(folder, "step-2")
    resumed = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    resumed.load_checkpoint(folder, "step-2")
    rates.append(resumed.train_step(batch)["optim/lr"])
    torch.save({"rates": rates, "version": learner.version}, out)


def test_the_schedule_counts_rl_steps_alone_across_sft_and_a_resume(tiny_qwen2, tmp_path):
    """Three SFT steps make policy versions but leave the RL schedule at its start: with a warm-up of 4, RL steps
    0 and 1 take 1/4 and 2/4 of the rate, and the step after a resume from their checkpoint 3/4."""
    out = tmp_path / "schedule.pt"
    mp.start_processes(
        _schedule_after_sft_main,
        args=(tiny_qwen2, _free_port(), str(out), str(tmp_path / "ckpt")),
        nprocs=1,
        start_method="spawn",
        join=True,
    )
    result = torch.load(out, weights_only=True)
    assert result["version"] == 5  # 3 SFT and 2 RL updates
    assert result["rates"] == pytest.approx([LEARNING_RATE / 4, LEARNING_RATE / 2, 3 * LEARNING_RATE / 4])


def _zero3_load_main(rank: int, world: int, model_path: str, port: int, out: str) -> None:
    import transformers

    from learner.rank import LearnerRank, LearnerSpec

    loaded = []
    plain = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        model = plain(*args, **kwargs)
        loaded.append(all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()))
        return model

    transformers.AutoModelForCausalLM.from_pretrained = recording
    LearnerRank(LearnerSpec(model_path=model_path, zero_stage=3), rank, world, "127.0.0.1", port)
    if rank == 0:
        torch.save(loaded, out)
    _leave_group()


def test_a_zero3_rank_loads_only_its_partition_of_the_model(tiny_qwen2, tmp_path):
    """Under ZeRO-3 the model comes out of from_pretrained already partitioned (DeepSpeed's ZeRO-3 init):
    no rank holds the whole model before the engine starts."""
    out = str(tmp_path / "zero3-load.pt")
    mp.start_processes(
        _zero3_load_main, args=(2, tiny_qwen2, _free_port(), out), nprocs=2, start_method="spawn", join=True
    )
    assert torch.load(out, weights_only=True) == [True]


def _short_batch_main(rank: int, world: int, model_path: str, port: int, out: str, groups: int, name: str) -> None:
    from algorithms import registry
    from learner.batch import rank_shards
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        learning_rate=LEARNING_RATE,
        adam_eps=ADAM_EPS,
        stabilizer_name=name,
        stabilizer_config=registry.build(name).config,
        loss_aggregation="token-mean",
    )
    learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
    samples = _batch_samples()
    kept = [[s for s in samples if s["group_id"] == group] for group in range(groups)]
    metrics = learner.train_step(rank_shards(kept, world, 0)[rank])
    weights = learner.state_dict_for_publish()
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)
    if world > 1:
        _leave_group()


@pytest.mark.parametrize(
    ("groups", "name"), [(1, "tis_seq"), (3, "tis_seq"), (1, "vcpo")], ids=["one-group", "three-groups", "one-vcpo"]
)
def test_a_short_batch_over_two_ranks_trains_every_group_as_one_rank_does(tiny_qwen2, tmp_path, groups, name):
    """A fixed lag does not replace a dropped group, so a step may bring fewer groups than the ranks split
    evenly: 3 over 2 ranks (one takes 2, the other 1) or 1 (the other rank joins with nothing to train on, which
    VCPO's per-group baseline must take too). Every group trains: the update and the logged reward and length
    are those of one rank on all of them."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"short-{groups}-{world}.pt"
        mp.start_processes(
            _short_batch_main,
            args=(world, tiny_qwen2, _free_port(), str(out), groups, name),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        runs[world] = torch.load(out, weights_only=True)
    alone, split = runs[1], runs[2]
    for key in ("rollout/reward_mean", "rollout/response_len", "optim/loss", "optim/grad_norm"):
        assert split["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-4), key
    assert split["metrics"]["stability/skipped_step"] == 0
    for name, tensor in alone["weights"].items():
        torch.testing.assert_close(split["weights"][name], tensor, rtol=1e-4, atol=1e-3 * LEARNING_RATE, msg=name)
