#!/usr/bin/env bash
# The one command a newcomer (and CI) runs: install the CPU test environment, then the test suite.
#   bash scripts/test.sh [pytest args...]
# Installs into $KDTREE_VENV (default: .venv in the checkout; reused when it exists) with
# scripts/install-cpu-env.sh, then runs pytest from the checkout. Exit status: pytest's, except
# that "no tests were collected" (pytest exit 5) is a failure too, with a message.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${KDTREE_VENV:-$root/.venv}"
export KDTREE_VENV="$venv"

bash "$root/scripts/install-cpu-env.sh"

cd "$root"
# The unit files: systemd-analyze verify, failing on any output (installs Debian's systemd package
# when systemd-analyze is missing). With it installed, the systemd tests must run, not skip.
bash "$root/systemd/lint.sh"
export KDTREE_REQUIRE_SYSTEMD_ANALYZE=1
set +e
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5): treating that as a failure" >&2
  exit 1
fi
exit "$rc"
