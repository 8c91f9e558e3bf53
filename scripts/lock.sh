#!/usr/bin/env bash
# Rewrites requirements/base.lock and requirements/dev.lock from pyproject.toml, keeping every pinned version the
# locks already hold (uv reads an existing output file's pins as preferences). To move them on purpose:
#   scripts/lock.sh                       add what pyproject.toml gained, change nothing else
#   scripts/lock.sh --upgrade-package X   move X (and what it needs) to its newest release
#   scripts/lock.sh --upgrade             move everything; run scripts/check_newest.sh first to see what breaks
# The locks are for CPython 3.11 on x86-64 Linux (CI's machine), with every file's hash (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv
opts=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
      --index-url https://pypi.org/simple --no-header -q)
.venv/bin/uv pip compile pyproject.toml --extra dev "${opts[@]}" -o requirements/dev.lock "$@"
# base: the dev lock's versions where they overlap, so both install the same torch, numpy, msgspec...
.venv/bin/uv pip compile pyproject.toml "${opts[@]}" -c requirements/dev.lock -o requirements/base.lock
echo "locks written: $(grep -c '^[A-Za-z0-9]' requirements/base.lock) base, $(grep -c '^[A-Za-z0-9]' requirements/dev.lock) dev packages"
