#!/usr/bin/env bash
# Creates .venv and installs packloader into it with the exact versions its test suite passed with.
#   scripts/setup.sh       the library and CLI             (requirements/base.lock)
#   scripts/setup.sh dev   + test tools and every optional integration: MDS, cl100k, transformers, megatron-core,
#                          deepspeed, the object-storage emulators, and headless Chromium for the report's browser
#                          test                             (requirements/dev.lock)
# The locks hold hashes and are for CPython 3.11 on x86-64 Linux, the machine CI runs on. Elsewhere the ranges in
# pyproject.toml are installed instead, and setup says so. Why a lock and how it moves: docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mode=${1:-base}
case "$mode" in base | dev) ;; *) echo "usage: scripts/setup.sh [dev]" >&2; exit 2 ;; esac
t0=$SECONDS
step() { printf 'setup [%3d s] %s\n' $((SECONDS - t0)) "$*"; }
pipq() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
# uv installs the same hash-checked wheels as pip, downloading and unpacking them in parallel (pip: one at a time,
# ~130 s of CI's setup). uv itself comes pinned by hash. PACKLOADER_SETUP_PIP=1, or any uv failure, means pip.
UV_PIN="uv==0.13.10 --hash=sha256:7cc9c41b43d583e34c781fd3446405b06e9c5fa2db468ce2a534d353db6429e5"
uv_locked() {
  [ "${PACKLOADER_SETUP_PIP:-0}" != 1 ] || return 1
  if [ ! -x .venv/bin/uv ]; then pipq --require-hashes --no-deps -r <(echo "$UV_PIN") || return 1; fi
  # where pip is configured to look as well (pip.conf, PIP_*), so uv finds what pip would
  local src=() u
  for u in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
    src+=(--find-links "$u"); done
  for u in $(.venv/bin/python -m pip config get global.extra-index-url 2>/dev/null) ${PIP_EXTRA_INDEX_URL:-}; do
    src+=(--extra-index-url "$u"); done
  .venv/bin/uv pip install -q --python .venv/bin/python --require-hashes --no-deps --native-tls \
    --index-strategy unsafe-best-match "${src[@]}" -r "$1"
}
locked() {
  uv_locked "$1" && return 0
  step "installing with pip instead of uv (slower: one package at a time)"
  pipq --require-hashes --no-deps -r "$1"
}

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
lock=requirements/$mode.lock
platform=$(.venv/bin/python -c 'import platform, sys; print(f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}-{platform.system()}-{platform.machine()}")')
if [ "$platform" = "cpython3.11-Linux-x86_64" ]; then
  n=$(grep -c '^[A-Za-z0-9]' "$lock")
  step "installing the $n locked packages of $lock with uv (torch 2.14.1 is several GB: well under a minute with the cache warm, a few minutes on a first download)"
  locked "$lock"
  step "installing packloader itself (editable)"
  pipq --no-deps -e .
else
  step "no lock for $platform (the locks are for cpython3.11-Linux-x86_64): installing pyproject.toml's ranges, an untested combination"
  pipq "torch==2.14.1" "torchvision==0.29.1"
  if [ "$mode" = dev ]; then pipq -e ".[dev]"; else pipq -e .; fi
fi

if [ "$mode" = dev ]; then
  # Azurite, the Azure Blob Storage emulator of tests/test_sources_gcs_azure.py (npm, locked in requirements/azurite)
  if ! command -v npm >/dev/null; then
    step "installing node and npm from Debian's packages (for Azurite)"
    { apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null; } || echo "setup: no npm; the Azure tests skip"
  fi
  if command -v npm >/dev/null && [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
    step "installing Azurite 3.35.0 with npm ci (about 20 s)"
    mkdir -p .tools/azurite && cp requirements/azurite/package.json requirements/azurite/package-lock.json .tools/azurite/
    (cd .tools/azurite && npm ci -s --no-audit --no-fund) || echo "setup: azurite not installed"
  fi
  step "headless Chromium for the report's browser test"
  bash scripts/setup_browser.sh || echo "setup: no chromium; tests/test_report_browser.py fails under CI=true"
fi
step "compiling packloader's numba kernels once, so the first plan does not wait for them (about 40 s of CPU)"
.venv/bin/packloader warmup
step "done"
