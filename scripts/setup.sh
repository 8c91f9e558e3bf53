#!/usr/bin/env bash
# Creates .venv and installs packloader into it. `scripts/setup.sh` for the library and CLI; `scripts/setup.sh dev`
# adds the test tools and every optional integration (MDS, cl100k, transformers, megatron-core, deepspeed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch and torchvision are pinned as a pair: mosaicml-streaming imports torchvision, which must match torch.
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
if [ "${1:-}" = "dev" ]; then
  .venv/bin/python -m pip install -q -e ".[dev]"
  # Azurite, the Azure Blob Storage emulator of tests/test_sources_gcs_azure.py (npm; node from Debian if missing)
  if ! command -v npm >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null; } || echo "setup: no npm; the Azure tests skip"
  fi
  if command -v npm >/dev/null && [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
    npm install -s --prefix .tools/azurite --no-audit --no-fund azurite@3 || echo "setup: azurite not installed"
  fi
else
  .venv/bin/python -m pip install -q -e .
fi
