#!/usr/bin/env bash
# Run here, on a development machine that reaches PyPI: fills .whl/ (git-ignored) with what
# deploy/gpu-bench.sh installs on a GPU machine that has CUDA torch, transformers, peft and accelerate
# but neither DeepSpeed nor its pure-Python needs, and no network. The pins are .venv's versions
# (tests/unit/benchmarks/test_benchmarks.py checks they agree), so the GPU run imports what CI tested.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEEPSPEED=deepspeed==0.19.8
# CPython 3.12 manylinux x86_64, the GPU machine's interpreter: pydantic and its parts (DeepSpeed's config
# and the job schema), hjson (DeepSpeed), PyYAML (the job files), typing-extensions at least as new as
# pydantic needs
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 hjson==3.1.0 PyYAML==6.0.4)

rm -rf .whl && mkdir .whl
sdist_dir=$(mktemp -d)
trap 'rm -rf "$sdist_dir"' EXIT
# DeepSpeed as a pure wheel with no ops compiled: the learner needs none (torch's AdamW), and a wheel built
# for this machine's CPU torch would not load ops on CUDA anyway
python3 -m pip download -q --no-deps --no-binary=:all: -d "$sdist_dir" "$DEEPSPEED"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$sdist_dir"/deepspeed-*.tar.gz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
