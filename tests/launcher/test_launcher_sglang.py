"""The launcher with the REAL `python -m sglang.launch_server` as its child (CPU, no weights).

The model folder holds only a config.json, so SGLang must die during start-up (today in this CPU
environment before its HTTP server is up; with more dependencies installed, at weight loading in
the scheduler). Whatever the cause, the launcher must report SGLang's own traceback and exit
non-zero, and leave no process of SGLang's group behind. One process tree importing sglang
twice: about 20-40 s on 2 cores.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures_ops" / "dsv3_tiny"


@pytest.mark.timeout(240)
def test_real_sglang_start_up_crash_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDTREE_", "NOTIFY_SOCKET"))}
    env.update(KDTREE_VERIFY="off", HF_HUB_OFFLINE="1", KDTREE_START_TIMEOUT="200", KDTREE_STOP_TIMEOUT="10")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch_with_kdtree.py"), "--model-path", str(MODEL), "--device", "cpu",
         "--port", str(port), "--host", "127.0.0.1"],
        env=env, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    err = proc.stderr
    assert proc.returncode not in (0, 78, 124), err[-4000:]
    assert "kdtree launcher: preflight passed" in err
    m = re.search(r"started SGLang as pid (\d+)", err)
    assert m, err[-4000:]
    assert "Traceback (most recent call last)" in err  # SGLang's own, repeated in the tail
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"kdtree launcher: error: SGLang (exited with code \d+|was killed by SIG\w+) during "
                        r"start-up after [\d.]+ s \(its output is above\); exiting \d+", last), last
    assert elapsed < 200
    with pytest.raises(ProcessLookupError):  # nothing of SGLang's process group is left
        os.killpg(int(m.group(1)), 0)
