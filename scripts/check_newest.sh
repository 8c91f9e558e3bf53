#!/usr/bin/env bash
# Runs the test suite against the newest releases of every dependency (pyproject.toml's ranges, not the locks) in
# a separate .venv-newest, and reports which packages moved past the lock and which tests broke, so the lock is
# moved on purpose (scripts/lock.sh --upgrade-package X) once they pass. The project's .venv is not touched.
#   scripts/check_newest.sh                     the whole suite
#   scripts/check_newest.sh tests/test_x.py -k y   pytest's arguments, to re-run a part
# Writes newest-report.txt; exits with pytest's code.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
step() { printf 'check_newest [%3d s] %s\n' $((SECONDS - t0)) "$*"; }
PY=${PYTHON:-python3}
[ -x .venv-newest/bin/python ] || { step "creating .venv-newest"; "$PY" -m venv .venv-newest; }
pipq() { .venv-newest/bin/python -m pip install -q --disable-pip-version-check "$@"; }
step "installing the newest releases that pyproject.toml admits (torch stays at the pinned 2.14.1 pair)"
pipq "torch==2.14.1" "torchvision==0.29.1" || exit 1
pipq --upgrade --upgrade-strategy eager -e ".[dev]" || exit 1
report=newest-report.txt
{
  echo "# packages newer than requirements/dev.lock"
  .venv-newest/bin/python - <<'PY'
import re
from importlib import metadata
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
locked = dict(m.groups() for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)==([^\s;\\]+)", open("requirements/dev.lock").read(), re.M))
locked = {norm(k): v for k, v in locked.items()}
moved = sorted((norm(d.metadata["Name"]), locked.get(norm(d.metadata["Name"])), d.version)
               for d in metadata.distributions() if norm(d.metadata["Name"]) != "packloader")
for name, old, new in moved:
    if old != new:
        print(f"{name}: {old or 'not in the lock'} -> {new}")
PY
} > "$report"
step "$(($(wc -l < "$report") - 1)) packages differ from the lock; running pytest"
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(-q -p no:cacheprovider)
.venv-newest/bin/python -m pytest -rfE "${args[@]}" 2>&1 | tee .newest-pytest.log
rc=${PIPESTATUS[0]}
{ echo; echo "# tests that failed with them (pytest exit $rc)"; grep -E '^(FAILED|ERROR) ' .newest-pytest.log || echo "none"; } >> "$report"
rm -f .newest-pytest.log
step "report: $report"
cat "$report"
exit "$rc"
