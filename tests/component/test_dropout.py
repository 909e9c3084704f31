"""Dropout off in the learner: a model whose config asks for attention dropout trains with none, so the log-probs,
ratios and passes of one step come from one function. A real LearnerRank (DeepSpeed ZeRO-2 over gloo)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from learner.ports import listenable_port


def _main(rank: int, model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    spec = LearnerSpec(
        model_path=model_path,
        zero_stage=2,
        stabilizer_name="tis_seq",
        stabilizer_config=registry.build("tis_seq").config,
    )
    learner = LearnerRank(spec, rank, 1, "127.0.0.1", port)
    samples = [
        dict(
            prompt_ids=[5, 6, 7],
            completion_ids=[8, 9, 10 + k],
            behaviour_logprobs=[-3.0] * 3,
            reward=float(k % 2),
            group_id=0,
            version=0,
        )
        for k in range(4)
    ]
    learner.train_step(collate(samples, 0))  # the step puts the model in training mode, as every step does
    module = learner.engine.module
    ids = torch.arange(2, 34).reshape(2, 16)
    with torch.no_grad():
        first, second = module(input_ids=ids).logits, module(input_ids=ids).logits
    torch.save(
        {
            "training": module.training,
            "same": torch.equal(first, second),
            "rates": [m.attention_dropout for m in module.modules() if hasattr(m, "attention_dropout")],
        },
        out,
    )


@pytest.mark.timeout(300)
def test_a_model_that_asks_for_dropout_trains_without_it(tiny_qwen2, tmp_path):
    folder = tmp_path / "dropout-qwen2"
    shutil.copytree(tiny_qwen2, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    out = str(tmp_path / "dropout.pt")
    mp.start_processes(_main, args=(str(folder), listenable_port(), out), nprocs=1, start_method="spawn", join=True)
    result = torch.load(out, weights_only=True)
    assert result["training"]  # still in training mode: gradient checkpointing needs it
    assert result["rates"] and all(rate == 0.0 for rate in result["rates"])
    assert result["same"], "two forwards of the policy differ: dropout is on"
