"""Learner ranks publish over the collective path: under ZeRO-3 both ranks gather each parameter in step
and only rank 0 sends, cast to the generators' dtype, to a member of the weight group in another process
(what a generator's stableasync_gloo engine runs; vLLM's nccl engine takes the same ranks on GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.component.test_learner import LEARNING_RATE, _free_port, _leave_group


def _learner_main(rank: int, model_path: str, ports: tuple[int, int], stage: int, out: str) -> None:
    from cluster.run.learner_group import LearnerActor
    from learner.rank import LearnerSpec
    from learner.weight_sync import CollectiveWeightSync, TensorSpec

    learner_port, weight_port = ports
    if rank == 2:  # a generator engine worker: rank 1 of the weight group
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        specs = [TensorSpec(name, tuple(p.shape), "bfloat16") for name, p in model.named_parameters()]
        sync = CollectiveWeightSync("127.0.0.1", weight_port, 1, 2)
        buckets = list(sync.receive(specs))
        torch.save(
            {
                "weights": {name: t.clone() for bucket in buckets for name, t in bucket},
                "largest_bucket": max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets),
            },
            out,
        )
        return
    spec = LearnerSpec(model_path=model_path, zero_stage=stage, learning_rate=LEARNING_RATE)
    learner = LearnerActor(spec, rank, 2, "127.0.0.1", learner_port)
    learner.join_weight_transfer("127.0.0.1", weight_port, 2, "gloo")
    assert (learner.transfer is not None) == (rank == 0)  # only rank 0 is in the weight group
    sent = learner.send_weights("bfloat16")
    torch.save(sent, f"{out}.sent{rank}")
    _leave_group()


def _run(model_path: str, stage: int, tmp_path) -> tuple[dict, list[int]]:
    out = str(tmp_path / f"received-z{stage}.pt")
    mp.start_processes(
        _learner_main,
        args=(model_path, (_free_port(), _free_port()), stage, out),
        nprocs=3,
        start_method="spawn",
        join=True,
    )
    return torch.load(out, weights_only=True), [torch.load(f"{out}.sent{r}", weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(300)  # a rank left waiting in a gather or the broadcast fails here
@pytest.mark.parametrize("stage", [2, 3])
def test_two_learner_ranks_publish_every_weight_once_in_bf16_from_rank_0(tiny_qwen2, tmp_path, stage):
    from transformers import AutoModelForCausalLM

    received, sent = _run(tiny_qwen2, stage, tmp_path)
    expected = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).named_parameters())
    weights = received["weights"]
    assert list(weights) == list(expected)
    for name, param in expected.items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], param.detach().bfloat16()), name
    total = sum(t.numel() * 2 for t in weights.values())
    assert sent == [total, 0]
    assert received["largest_bucket"] <= 512 << 20  # the receiver holds one bucket, not the model


def test_the_rendezvous_address_is_on_learner_rank_0s_node():
    """The weight group's store is hosted by learner rank 0: its address must come from that node, not from
    wherever Ray would run an unplaced task (the head). Two nodes here: the head and a `learner` node."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    from cluster.run import learner_group

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    learner_node = cluster.add_node(num_cpus=1, resources={"learner": 1})
    try:
        ray.init(address=cluster.address)

        class Placed(learner_group.LearnerGroup):  # the group's placement only: no learner process is started
            def __init__(self) -> None:
                self.placement = placement_group([{"CPU": 0.5, "learner": 1}])
                ray.get(self.placement.ready())

        rendezvous = Placed().rendezvous_address()
        assert rendezvous.node_id == learner_node.node_id != ray.get_runtime_context().get_node_id()
        assert 0 < rendezvous.port < 65536
    finally:
        ray.shutdown()
        cluster.shutdown()
