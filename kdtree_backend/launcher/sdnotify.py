"""sd_notify without a library: one AF_UNIX datagram to $NOTIFY_SOCKET.

The protocol (sd_notify(3)): newline-separated `KEY=value` assignments in one datagram sent to the
socket named by `NOTIFY_SOCKET`; a leading `@` names a socket in the abstract namespace (the `@` is
replaced by a NUL byte). Outside systemd the variable is unset and every call is a no-op.

Send from the unit's main process only (the drop-in sets `NotifyAccess=main`); a helper process
such as `systemd-notify` can be misattributed. The launcher removes NOTIFY_SOCKET (and the watchdog
variables) from its child's environment so SGLang never talks to systemd itself.

The watchdog (sd_watchdog_enabled(3)): with `WatchdogSec=` in the unit, systemd puts
`WATCHDOG_USEC` (the timeout in microseconds) and `WATCHDOG_PID` (the process it expects keep-alives
from) in the main process's environment, and stops the service when no `WATCHDOG=1` arrives for
that long after start-up.
"""
from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

__all__ = ["notify", "socket_address", "watchdog_usec", "NotifyError", "WATCHDOG_VARS"]

WATCHDOG_VARS = ("WATCHDOG_USEC", "WATCHDOG_PID")


class NotifyError(OSError):
    """The notification socket is set but unusable (a broken unit setup, reported loudly)."""


def socket_address(environ: Optional[Mapping[str, str]] = None):
    """The address `NOTIFY_SOCKET` names (str path or abstract bytes), or None when unset."""
    env = os.environ if environ is None else environ
    addr = env.get("NOTIFY_SOCKET", "")
    if not addr:
        return None
    if addr.startswith("@"):
        return b"\0" + addr[1:].encode()
    if not addr.startswith("/"):
        # sd_notify also accepts vsock:... addresses (VMs); the launcher does not need them.
        raise NotifyError(f"NOTIFY_SOCKET={addr!r} is neither an absolute path nor an @abstract name")
    return addr


def notify(state: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving"). Returns False when not under systemd.

    Raises NotifyError when NOTIFY_SOCKET is set but the datagram cannot be delivered: systemd
    would then never see READY=1 and would kill the service at TimeoutStartSec, so the caller
    should say so rather than carry on silently.
    """
    addr = socket_address(environ)
    if addr is None:
        return False
    data = state.encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sent = sock.send(data)
    except OSError as exc:
        raise NotifyError(f"cannot send to NOTIFY_SOCKET {addr!r}: {exc}") from exc
    if sent != len(data):
        raise NotifyError(f"short send to NOTIFY_SOCKET {addr!r}: {sent} of {len(data)} bytes")
    return True


def watchdog_usec(environ: Optional[Mapping[str, str]] = None, pid: Optional[int] = None) -> Optional[int]:
    """The watchdog timeout systemd asks of process `pid` (default: this one) in microseconds, or None.

    None when `WATCHDOG_USEC` is unset or empty, or when `WATCHDOG_PID` names another process (the
    variables were inherited, the watchdog is not ours). Raises ValueError when either variable is
    set to something that is not a positive integer: a broken unit setup the caller should report.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        usec = 0
    if usec <= 0:
        raise ValueError(f"WATCHDOG_USEC={raw!r} is not a positive number of microseconds")
    raw_pid = env.get("WATCHDOG_PID", "").strip()
    if raw_pid:
        try:
            wpid = int(raw_pid)
        except ValueError:
            wpid = 0
        if wpid <= 0:
            raise ValueError(f"WATCHDOG_PID={raw_pid!r} is not a process id")
        if wpid != (os.getpid() if pid is None else pid):
            return None
    return usec
