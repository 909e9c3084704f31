"""Device correctness of the learner step, checked on CPU with 2 ranks.

On a GPU a rank computes on its CUDA device while a tensor built without `device=` lands on the host, and
such a tensor fails the step where it meets a device tensor or reaches NCCL. Here the host is played by
PyTorch's `meta` device: the steps run under `torch.device("meta")`, so every tensor the step builds
without naming a device is a meta tensor, and fails where a host tensor would fail on a GPU (mixed with the
rank's CPU tensors, or read back). Every torch.distributed collective is wrapped to refuse a tensor that is
not on the rank's device, naming the call.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import _batch_samples, _free_port, _leave_group

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "reduce_scatter",
    "gather",
    "scatter",
)


class WrongDevice(AssertionError):
    """A tensor handed to a collective is not on the rank's device."""


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _guard_collectives(device: torch.device, calls: dict[str, int]) -> None:
    """Wrap each torch.distributed collective (DeepSpeed's comm calls them through the module too)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def guarded(*args, _name=name, _original=original, **kwargs):
            for tensor in _tensors(list(args) + list(kwargs.values())):
                if tensor.device != device:
                    raise WrongDevice(
                        f"torch.distributed.{_name} got a {tuple(tensor.shape)} tensor on "
                        f"{tensor.device}; the rank computes on {device}"
                    )
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, guarded)


def _devices_main(rank: int, world: int, stage: int, names: list[str], model_path: str, port: int, out: str) -> None:
    from algorithms import registry
    from learner.batch import collate
    from learner.rank import LearnerRank, LearnerSpec

    share = collate([s for s in _batch_samples() if s["group_id"] % world == rank], 0)
    calls: dict[str, int] = {}
    outcomes = {}
    for name in names:
        for budget in (None, 100):  # the whole batch in one micro-batch; split in several (two passes where due)
            spec = LearnerSpec(
                model_path=model_path,
                zero_stage=stage,
                learning_rate=1e-3,
                stabilizer_name=name,
                stabilizer_config=registry.build(name).config,
                max_tokens_per_micro_batch=budget,
            )
            learner = LearnerRank(spec, rank, world, "127.0.0.1", port)
            if not calls:
                _guard_collectives(learner.device, calls)
            try:
                with torch.device("meta"):
                    learner.train_step(share)
                    if name == names[0]:
                        learner.sft_step(share, 1e-3)
                        learner.state_dict_for_publish()
                outcomes[f"{name}/{budget}"] = "ok"
            except Exception as error:
                import traceback

                where = [
                    f"{frame.filename}:{frame.lineno}"
                    for frame in traceback.extract_tb(error.__traceback__)
                    if "site-packages" not in frame.filename
                ][-3:]
                outcomes[f"{name}/{budget}"] = f"{type(error).__name__}: {str(error)[:200]} at {where}"
    with torch.device("meta"):  # the guard itself: a host-built tensor handed to a collective is refused
        try:
            torch.distributed.all_reduce(torch.zeros(1))
            outcomes["guard"] = "a meta tensor reached all_reduce"
        except WrongDevice as error:
            outcomes["guard"] = str(error)
    if rank == 0:
        with open(out, "w") as file:
            json.dump({"outcomes": outcomes, "calls": calls}, file)
    _leave_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage, names", [(2, None), (3, ["tis_seq", "m2po", "vcpo"])])
def test_every_tensor_of_the_step_is_on_the_ranks_device(tiny_qwen2, tmp_path, stage, names):
    from algorithms.registry import STABILIZERS

    names = names or sorted(STABILIZERS)
    out = tmp_path / "devices.json"
    mp.start_processes(
        _devices_main,
        args=(2, stage, names, tiny_qwen2, _free_port(), str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    result = json.loads(out.read_text())
    outcomes = result.pop("outcomes") if "outcomes" in result else {}
    guard = outcomes.pop("guard")
    assert guard.startswith("torch.distributed.all_reduce got a (1,) tensor on meta"), guard
    failures = {case: outcome for case, outcome in outcomes.items() if outcome != "ok"}
    assert not failures, json.dumps(failures, indent=1)
    assert len(outcomes) == 2 * len(names)
    assert result["calls"].get("all_reduce", 0) > 0  # the guard saw the step's own collectives
    if stage == 3:
        assert result["calls"].get("all_gather_into_tensor", 0) + result["calls"].get("all_gather", 0) > 0
