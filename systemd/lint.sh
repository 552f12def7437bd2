#!/usr/bin/env bash
# Lint the unit files with `systemd-analyze verify` and fail on ANY output, not only on its exit
# code: a misspelled key ("Unknown key 'TimeoutStartSecs'") is only a warning and exits 0.
#
#   systemd/lint.sh [DIR]      DIR holds 50-kdtree.conf and sglang-kdtree.service (default: here)
#
# Installs systemd-analyze (Debian package `systemd`) with apt-get when it is missing, unless
# KDTREE_LINT_NO_INSTALL=1. Checks: the example full unit on its own, and the drop-in applied to a
# stand-in base unit `sglang.service` (a drop-in cannot be verified alone). ExecStart= must name an
# existing binary during verify, so /opt/sglang/venv/bin/python is replaced by this machine's python3.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "${1:-$here}" && pwd)"

if ! command -v systemd-analyze >/dev/null 2>&1; then
  if [ "${KDTREE_LINT_NO_INSTALL:-0}" = "1" ]; then
    echo "lint.sh: systemd-analyze not found (KDTREE_LINT_NO_INSTALL=1)" >&2
    exit 1
  fi
  echo "lint.sh: systemd-analyze not found; installing the Debian package systemd" >&2
  sudo_=""
  if [ "$(id -u)" != "0" ]; then sudo_="sudo"; fi
  $sudo_ apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends systemd >&2
fi

python="$(command -v python3 || command -v python)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
units="$tmp/units"
mkdir -p "$units/sglang.service.d"

# What an existing SGLang install's unit looks like; the drop-in is applied on top of it.
cat > "$units/sglang.service" <<UNIT
[Unit]
Description=SGLang (stand-in base unit for lint)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart=$python -m sglang.launch_server --model-path /models/x

[Install]
WantedBy=multi-user.target
UNIT
sed "s#/opt/sglang/venv/bin/python#$python#g" "$src/50-kdtree.conf" > "$units/sglang.service.d/50-kdtree.conf"
sed "s#/opt/sglang/venv/bin/python#$python#g" "$src/sglang-kdtree.service" > "$units/sglang-kdtree.service"

verify() {
  # SYSTEMD_UNIT_PATH ending in ':' appends the default search path (targets such as
  # network-online.target must resolve); the drop-in is found as sglang.service.d/ in $units.
  (cd "$units" && SYSTEMD_UNIT_PATH="$units:" systemd-analyze verify --man=no "$@" 2>&1) || return $?
}

# 1. Prove the drop-in directory is really read: a canary key must be reported.
printf '[Service]\nKdtreeLintCanary=1\n' > "$units/sglang.service.d/99-canary.conf"
canary="$(verify "$units/sglang.service" || true)"
rm -f "$units/sglang.service.d/99-canary.conf"
if ! grep -q "KdtreeLintCanary" <<<"$canary"; then
  echo "lint.sh: systemd-analyze did not read the drop-in directory; cannot lint 50-kdtree.conf:" >&2
  echo "$canary" >&2
  exit 1
fi

# 2. The real thing: no output at all, exit code 0.
rc=0
out="$(verify "$units/sglang.service" "$units/sglang-kdtree.service")" || rc=$?
if [ "$rc" != "0" ] || [ -n "$out" ]; then
  echo "lint.sh: systemd-analyze verify (exit $rc) reported:" >&2
  echo "$out" | sed "s#$units/#systemd/#g" >&2
  exit 1
fi
echo "lint.sh: OK: sglang-kdtree.service and 50-kdtree.conf (applied to a base sglang.service) pass systemd-analyze verify"
