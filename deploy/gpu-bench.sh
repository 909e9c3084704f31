#!/usr/bin/env bash
# On a lent GPU machine (CUDA torch, transformers, peft and accelerate installed; no network), from the
# repository root, after deploy/gpu-wheels.sh filled .whl/ on a machine with PyPI: the CUDA tests, then the
# learner benchmarks on random-weight models of the published shapes (benchmarks/model_configs.py). Each
# section has its own time limit, so the whole run ends within about 9 minutes even if one hangs (on an H200 on 2026-11-27
# a SmolLM2 configuration took about 35 s, a Qwen2.5-1.5B one about 35 s at 2 rounds); each benchmark
# prints its rows as they are measured, so a section cut short keeps what it measured. Everything goes to
# ${OUT:-/tmp}/gpu-bench.log; the exit status is non-zero when any section failed or ran out of time.
# Qwen2.5-1.5B at 64 x 1024 without gradient checkpointing may not fit an H100's 80 GB: an H200 has room.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu-bench.log"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
# the benchmarks' per-configuration processes inherit this environment; STABLEASYNC_NATIVE=0: the fused CPU
# scans are not compiled here (the stabilizers take their torch path, which CUDA tensors take anyway)
export PYTHONPATH="/tmp/site:$PWD" DS_ACCELERATOR=cuda STABLEASYNC_NATIVE=0 PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

failed=0
section() {  # section LIMIT_S COMMAND...: runs COMMAND, killed with its processes after LIMIT_S seconds
  local limit_s=$1 started=$SECONDS status=0
  shift
  echo "=== $* (limit ${limit_s} s)"
  timeout -k 10 "$limit_s" "$@" || status=$?
  echo "=== exit ${status}$([ "$status" = 124 ] && echo ' (time limit)') after $((SECONDS - started)) s"
  [ "$status" = 0 ] || failed=1
}

{
  # the card and the torch, transformers, DeepSpeed and peft that ran, each beside the gpu extra's pin
  section 20 python3 -m benchmarks.stack_versions
  section 90 python3 -m pytest -q -p no:cacheprovider tests/gpu
  # tis_seq-compiled: learner.compile layers (inductor compiles in the warm-up step)
  section 180 python3 -m benchmarks.learner_step --model-config smollm2-135m --sequences 64 --tokens 512 \
    --budget 8192 --configs tis_seq,tis_seq-compiled,vcpo-auto --profile tis_seq,tis_seq-compiled,vcpo-auto
  # responses of drawn lengths (mean 247 of at most 1023 tokens, 90th percentile 4x the 10th): packed against
  # padded micro-batches, and VCPO where rows differ in length
  section 110 python3 -m benchmarks.learner_step --model-config smollm2-135m --sequences 64 --tokens 1024 \
    --budget 8192 --lengths lognormal:256:1024 --configs tis_seq,tis_seq-padded,vcpo-auto
  # Qwen2.5-1.5B: VCPO's norms through the fused output layer and from the whole [tokens, vocabulary] logits
  section 150 python3 -m benchmarks.learner_step --model-config qwen2.5-1.5b --sequences 64 --tokens 1024 \
    --budget 16384 --rounds 2 --lengths lognormal:256:1024 --configs tis_seq,vcpo-auto,vcpo-auto-logits,tis_seq-gc
  section 45 python3 -m benchmarks.learner_memory --model-config smollm2-135m --sequences 16,64 --tokens 512 \
    --stabilizers tis_seq
  exit "$failed"
} 2>&1 | tee "$log"
