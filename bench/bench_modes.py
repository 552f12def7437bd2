"""Overhead of KDTREE_VERIFY=off / validate / on per `TritonAttnBackend.forward_extend` call (GPU).

SGLang's real Triton backend (built with its test kit, like tests/sglang/test_backend_gpu.py), a
TARGET_VERIFY batch, and `LAYERS` forward_extend calls captured in ONE CUDA graph (the way a
model's layers are), replayed `iters` times; before each replay the step's out-of-graph work
runs as in production (`init_forward_metadata_out_graph`, which in validate also runs the
host side of the stats ring). Also times eager calls (hook Python included): the wall time per
call (GPU work included) and the host time per call (issuing one step's calls on an idle GPU, no
synchronisation inside), and from them the host time our Python adds per call in each mode:
`host_added_us` = eager host time per call in off / validate / on minus stock's (no hook), and
`eager_wall_added_us` the same for the wall time. Prints a table per batch size; `bench()` returns
them as a dict. Under a minute per batch size on an H200 (2k prefixes; bs 128 fits easily).

    PYTHONPATH=/tmp/site:.whl/placeholder:$PWD python3 bench/bench_modes.py [--heads 8 --bs 8,128 \
        --draft 4 --prefix 2048 --kind tree --json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kdtree_backend.testing import scene

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 8
MODES = (("stock", "stock", 1.0), ("off", "off", 1.0), ("validate", "validate", 1.0),
         ("validate@0.25", "validate", 0.25), ("on", "on", 1.0))


def _install_hook():
    """The hook installed once for the whole run (HookRegistry's AROUND shape); returns the original."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from kdtree_backend.sglang import hook

    orig = TritonAttnBackend.forward_extend
    if getattr(orig, "__kdtree_bench__", False):
        return orig.__wrapped__

    def wrapper(*args, **kwargs):
        return hook.forward_extend_hook(orig, *args, **kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__kdtree_bench__ = True
    TritonAttnBackend.forward_extend = wrapper
    return orig


def _us_per_layer_call(run_step, n: int) -> tuple:
    """3 warm-up steps, then n timed ones: (GPU µs, host wall µs) per layer call; a step runs all
    LAYERS layers."""
    for _ in range(3):
        run_step()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        run_step()
    e1.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / (n * LAYERS) * 1e6
    return e0.elapsed_time(e1) * 1e3 / (n * LAYERS), wall


def _host_us_per_layer_call(run_step, n: int) -> float:
    """Host time to issue one step's LAYERS calls on an idle GPU (synchronised before, not inside),
    median over n steps, per call: the Python and launch cost, not the kernels'."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / LAYERS * 1e6


def _one(original, mode, *, heads, bs, draft, prefix, kind, iters, sample_rate=1.0):
    from kdtree_backend.sglang import shadow

    stock = mode == "stock"
    scene.set_mode("off" if stock else mode, sample_rate=sample_rate)
    sc = scene.Scene(bs=bs, D=draft, kind=kind, heads=heads, graph=True, max_context_len=prefix + draft + 8, seed=1)
    sc.backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * draft)
    sc.load([1] * bs)
    with sc.ctx_():
        sc.backend.init_forward_metadata_out_graph(sc.batch, in_capture=True)

    def step():
        if stock:
            return [sc.forward(original) for _ in range(LAYERS)]
        return [sc.forward() for _ in range(LAYERS)]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # same stream as the warm-ups, like SGLang
        step()
    sc.load([prefix] * bs)

    def replay_step():
        with sc.ctx_():
            sc.backend.init_forward_metadata_out_graph(sc.batch)
        g.replay()

    gpu, wall = _us_per_layer_call(replay_step, iters)
    # eager: metadata once, then forward_extend calls (hook Python + kernels)
    sc.init_eager()
    eager_gpu, eager_wall = _us_per_layer_call(step, max(5, iters // 4))
    eager_host = _host_us_per_layer_call(step, max(5, iters // 4))
    published = shadow.flush_all() if mode == "validate" else 0
    del g
    return {"graph_us_per_call_gpu": gpu, "graph_us_per_call_wall": wall,
            "eager_us_per_call_gpu": eager_gpu, "eager_us_per_call_wall": eager_wall,
            "eager_us_per_call_host": eager_host, "validations_published": published}


def add_comparisons(rows: dict) -> dict:
    """Each mode against off (graph GPU time, eager wall time) and against stock: the host time and
    the eager wall time per call that our hook adds (stock runs SGLang's forward_extend unwrapped)."""
    base, stock = rows["off"], rows["stock"]
    for r in rows.values():
        r["graph_gpu_vs_off"] = r["graph_us_per_call_gpu"] / base["graph_us_per_call_gpu"]
        r["eager_wall_vs_off"] = r["eager_us_per_call_wall"] / base["eager_us_per_call_wall"]
        r["host_added_us"] = r["eager_us_per_call_host"] - stock["eager_us_per_call_host"]
        r["eager_wall_added_us"] = r["eager_us_per_call_wall"] - stock["eager_us_per_call_wall"]
    return rows


def format_table(cfg: dict, rows: dict) -> str:
    cols = (("graph gpu us", "graph_us_per_call_gpu", "13.1f"), ("graph wall us", "graph_us_per_call_wall", "14.1f"),
            ("eager gpu us", "eager_us_per_call_gpu", "13.1f"), ("eager wall us", "eager_us_per_call_wall", "14.1f"),
            ("eager host us", "eager_us_per_call_host", "14.1f"), ("+host vs stock", "host_added_us", "15.1f"),
            ("+wall vs stock", "eager_wall_added_us", "15.1f"), ("graph x off", "graph_gpu_vs_off", "12.2f"),
            ("eager x off", "eager_wall_vs_off", "12.2f"))
    lines = [f"forward_extend per call, {cfg}",
             f"{'mode':14}" + "".join(f"{h:>{int(spec.split('.')[0])}}" for h, _, spec in cols)]
    for name, r in rows.items():
        lines.append(f"{name:14}" + "".join(f"{r[key]:{spec}}" for _, key, spec in cols))
    return "\n".join(lines)


def bench(heads=8, bs=8, draft=4, prefix=2048, kind="tree", iters=50, candidate=None) -> dict:
    """Time stock / off / validate (rate 1 and 0.25) / on at one batch size. `candidate`
    overrides the kernel."""
    import warnings

    warnings.filterwarnings("ignore")
    from kdtree_backend.sglang import hook

    original = _install_hook()
    hook.set_candidate(candidate)
    rows = {}
    try:
        for name, mode, rate in MODES:
            rows[name] = _one(original, mode, heads=heads, bs=bs, draft=draft, prefix=prefix, kind=kind,
                              iters=iters, sample_rate=rate)
    finally:
        hook.set_candidate(None)
    add_comparisons(rows)
    cfg = dict(heads=heads, bs=bs, draft=draft, prefix=prefix, kind=kind, iters=iters, layers=LAYERS,
               device=torch.cuda.get_device_name())
    print("\n" + format_table(cfg, rows), flush=True)
    return {"config": cfg, "modes": rows}


def parse_bs(text: str) -> list:
    """"8,128" -> [8, 128]."""
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"--bs wants batch sizes >= 1, got {text!r}")
    return vals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--bs", default="8", help="batch size(s), comma-separated: 8,128 runs both")
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=2048, help="prefix length of every request (sizes the pool)")
    ap.add_argument("--kind", choices=["tree", "chain"], default="tree")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        sizes = parse_bs(a.bs)
    except ValueError as e:
        ap.error(str(e))
    res = {"by_bs": {}}
    for bs in sizes:
        res["by_bs"][str(bs)] = bench(a.heads, bs, a.draft, a.prefix, a.kind, a.iters)
        if a.json:  # after every batch size: a run cut short keeps what it measured
            Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
