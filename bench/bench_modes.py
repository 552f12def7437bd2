"""Overhead of KDTREE_VERIFY=off / validate / on per `TritonAttnBackend.forward_extend` call (GPU).

SGLang's real Triton backend (built with its test kit, like tests/gpu/test_backend_gpu.py), a
TARGET_VERIFY batch, and `LAYERS` forward_extend calls captured in ONE CUDA graph (the way a
model's layers are), replayed `iters` times; before each replay the step's out-of-graph work
runs as in production (`init_forward_metadata_out_graph`, which in validate also runs the
host side of the stats ring). Also times eager calls (hook Python included). Prints a table;
`bench()` returns it as a dict. Runs in well under a minute on an H200.

    PYTHONPATH=/tmp/site:.whl/placeholder:$PWD python3 bench/bench_modes.py [--heads 8 --bs 8 \
        --draft 4 --prefix 2048 --kind tree --json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 8


def _scene_module():
    # The scene imports its shared helpers from tests/conftest.py, which pytest makes importable by
    # putting tests/ on sys.path; do the same here (without it this script failed to start).
    tests_dir = str(ROOT / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    spec = importlib.util.spec_from_file_location("_kdtree_backend_gpu_scene", ROOT / "tests" / "gpu" / "test_backend_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _install_hook():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from kdtree_backend import hook

    orig = TritonAttnBackend.forward_extend
    if getattr(orig, "__kdtree_bench__", False):
        return orig.__wrapped__

    def wrapper(*args, **kwargs):
        return hook.forward_extend_hook(orig, *args, **kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__kdtree_bench__ = True
    TritonAttnBackend.forward_extend = wrapper
    return orig


def _set_mode(mode: str, sample_rate: float = 1.0):
    from kdtree_backend import hook, logs, shadow
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    shadow.reset_for_tests()
    hook.reset_for_tests(mode=Mode(mode), settings=shadow.Settings(sample_rate=sample_rate))


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


def _one(mod, original, mode, *, heads, bs, draft, prefix, kind, iters, sample_rate=1.0):
    from kdtree_backend import shadow

    mod.H = heads
    stock = mode == "stock"
    _set_mode("off" if stock else mode, sample_rate)
    sc = mod.Scene(bs=bs, D=draft, kind=kind, graph=True, max_context_len=prefix + draft + 8, seed=1)
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
    published = shadow.flush_all() if mode == "validate" else 0
    del g
    return {"graph_us_per_call_gpu": gpu, "graph_us_per_call_wall": wall,
            "eager_us_per_call_gpu": eager_gpu, "eager_us_per_call_wall": eager_wall,
            "validations_published": published}


def bench(heads=8, bs=8, draft=4, prefix=2048, kind="tree", iters=50, candidate=None) -> dict:
    """Time stock / off / validate (rate 1 and 0.25) / on. `candidate` overrides the kernel."""
    import warnings

    warnings.filterwarnings("ignore")
    from kdtree_backend import hook

    mod = _scene_module()
    original = _install_hook()
    hook.set_candidate(candidate)
    rows = {}
    try:
        for name, mode, rate in [("stock", "stock", 1.0), ("off", "off", 1.0), ("validate", "validate", 1.0),
                                 ("validate@0.25", "validate", 0.25), ("on", "on", 1.0)]:
            rows[name] = _one(mod, original, mode, heads=heads, bs=bs, draft=draft, prefix=prefix, kind=kind,
                              iters=iters, sample_rate=rate)
    finally:
        hook.set_candidate(None)
    base = rows["off"]
    for r in rows.values():
        r["graph_gpu_vs_off"] = r["graph_us_per_call_gpu"] / base["graph_us_per_call_gpu"]
        r["eager_wall_vs_off"] = r["eager_us_per_call_wall"] / base["eager_us_per_call_wall"]
    cfg = dict(heads=heads, bs=bs, draft=draft, prefix=prefix, kind=kind, iters=iters, layers=LAYERS,
               device=torch.cuda.get_device_name())
    print(f"\nforward_extend per call, {cfg}")
    print(f"{'mode':14} {'graph gpu us':>13} {'graph wall us':>14} {'eager gpu us':>13} {'eager wall us':>14} {'graph x off':>11} {'eager x off':>11}")
    for name, r in rows.items():
        print(f"{name:14} {r['graph_us_per_call_gpu']:13.1f} {r['graph_us_per_call_wall']:14.1f} "
              f"{r['eager_us_per_call_gpu']:13.1f} {r['eager_us_per_call_wall']:14.1f} "
              f"{r['graph_gpu_vs_off']:11.2f} {r['eager_wall_vs_off']:11.2f}")
    return {"config": cfg, "modes": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--kind", choices=["tree", "chain"], default="tree")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = bench(a.heads, a.bs, a.draft, a.prefix, a.kind, a.iters)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
