#!/usr/bin/env bash
# Installs Debian's chromium for the HTML report's browser test (tests/test_report_browser.py) when no chromium is
# on PATH. Idempotent and quiet: one line says what it does (apt's output only if it fails).
set -euo pipefail
for b in chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null; then
    echo "setup_browser: $b already installed ($(command -v "$b"))"
    exit 0
  fi
done
echo "setup_browser: installing Debian's chromium with apt-get (about a minute)"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
log=$(mktemp)
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "setup_browser: apt-get failed; tests/test_report_browser.py skips without chromium (fails under CI=true)" >&2
  exit 1
fi
rm -f "$log"
