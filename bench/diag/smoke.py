"""Kernel smoke check for one GPU call: correctness on random trees against a float64 torch
reference (on every kernel path it times), then CUDA-graph timings of a few shapes against SGLang's
Triton extend kernel.

    python bench/diag/smoke.py [--no-triton] [--configs portable,hopper] [--json out.json]

The full test suite is tests/kernel/test_kernel_gpu.py; the full benchmark is bench/bench_verify.py.
This script is the quick look taken after each kernel change (small, ~1 minute), and what the
device driver (bench/device/run.py) runs for racecheck (--small), the ncu profile
(--profile-shape) and the A/B timings of variant libraries (--configs, --json); --sweep-min-keys
times the split rule's threshold. Its float64 reference is written independently of
kdtree_backend/testing/reference.py on purpose (plain einsum per request): two references written
apart cross-check each other. The other diagnostics here import it for `make_batch` and
`shape_arg` (it also puts the checkout on sys.path).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kdtree_backend.kernel.ops import verify_attention  # noqa: E402
from kdtree_backend.testing.batches import slot_runs  # noqa: E402
# the benchmark's --slots and its KDTREE_KERNEL switch (bench_verify imports the standard library only)
from bench.bench_verify import SLOT_ORDERS, kernel_path  # noqa: E402


def shape_arg(spec: str) -> tuple:
    """"B,H,n,L" -> (B, H, n, L)."""
    B, H, n, L = (int(x) for x in spec.split(","))
    return B, H, n, L


def shape_batch(spec: str, seed: int) -> tuple:
    """(B, H, n, L) and make_batch's arguments for one "B,H,n,L" shape (every request L long)."""
    B, H, n, L = shape_arg(spec)
    return (B, H, n, L), make_batch(B, H, n, [L] * B, seed=seed, pool_extra=L)


def slot_order(layout: str, total: int, pool: int, perm: torch.Tensor, seed: int) -> torch.Tensor:
    """The prefix slots, in request order, of a pool of `pool` slots: "random" is `perm` (a random
    permutation's first `total`); "contiguous" is 0, 1, ... (SGLang's page size 64, or a fresh
    page-size-1 pool: every request's prefix one run); "runs" cuts the pool into runs of 1-300
    consecutive slots in a random order (a page-size-1 pool after some traffic: prefill prefixes are
    runs, journal m22; the test batches' `slot_runs`). Drawn from a generator of their own, so the
    batch's other inputs do not change with the layout."""
    if layout == "random":
        return perm
    if layout == "contiguous":
        return torch.arange(total, dtype=perm.dtype)
    if layout != "runs":
        raise ValueError(f"slot layout must be one of {SLOT_ORDERS}, got {layout!r}")
    return slot_runs(0, pool, random.Random(seed + 7919))[:total].to(perm.dtype)


def make_batch(B, H, n, prefix_lens, *, mask_kind="tree", mask_dtype=torch.uint8, qo_dtype=torch.int32,
               device="cuda", seed=0, pool_extra=1000, slots="random"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = B * n
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(T, 1, 576, generator=g).to(torch.bfloat16).to(device)
    total = sum(prefix_lens)
    N = total + pool_extra
    kv = torch.randn(N, 1, 576, generator=g).to(torch.bfloat16).to(device)
    perm = slot_order(slots, total, N, torch.randperm(N, generator=g)[:total], seed)
    kv_indices = torch.cat([perm, torch.randint(0, N, (17,), generator=g)]).to(torch.int64).to(device)
    kv_indptr = torch.tensor([0] + list(torch.tensor(prefix_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    qo_indptr = (torch.arange(B + 1) * n).to(qo_dtype).to(device)
    mask = mask_indptr = None
    if mask_kind != "none":
        blocks, starts = [], [0]
        for b in range(B):
            P = prefix_lens[b]
            anc = torch.zeros(n, n, dtype=torch.bool)
            for c in range(n):
                anc[c, c] = True
                if c > 0:
                    parent = int(torch.randint(0, c, (1,), generator=g)) if mask_kind == "tree" else c - 1
                    anc[c] |= anc[parent]
            garbage = torch.randint(0, 2, (n, P), generator=g).bool()  # prefix columns: never read
            blocks.append(torch.cat([garbage, anc], 1).flatten())
            starts.append(starts[-1] + n * (P + n))
        mask = torch.cat(blocks).to(mask_dtype).to(device)
        mask_indptr = torch.tensor(starts, dtype=torch.int64, device=device)
    return dict(q=q, k=k, kv_cache=kv, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                custom_mask=mask, mask_indptr=mask_indptr, sm_scale=192 ** -0.5, max_qo_len=n)


def reference(a, k_scale=1.0, v_scale=1.0):
    q, k, kv = a["q"].double(), a["k"].double().reshape(-1, 576), a["kv_cache"].double().reshape(-1, 576)
    qo, kvp, kvi = a["qo_indptr"].tolist(), a["kv_indptr"].tolist(), a["kv_indices"]
    T, H, _ = q.shape
    out = torch.zeros(T, H * 512, dtype=torch.float64, device=q.device)
    for b in range(len(qo) - 1):
        q0, q1, P = qo[b], qo[b + 1], kvp[b + 1] - kvp[b]
        n = q1 - q0
        Kp = kv[kvi[kvp[b]:kvp[b + 1]]]
        Kd = k[q0:q1]
        Q = q[q0:q1]
        sp = torch.einsum("nhd,pd->nhp", Q, Kp) * a["sm_scale"] * k_scale
        sd = torch.einsum("nhd,cd->nhc", Q, Kd) * a["sm_scale"]
        if a["custom_mask"] is not None:
            m0 = int(a["mask_indptr"][b])
            vis = a["custom_mask"][m0:m0 + n * (P + n)].reshape(n, P + n)[:, P:] != 0
        else:
            vis = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        sd = sd.masked_fill(~vis[:, None, :], float("-inf"))
        p = torch.softmax(torch.cat([sp, sd], -1), -1).nan_to_num(0.0)
        o = torch.einsum("nhp,pd->nhd", p[..., :P], Kp[:, :512]) * v_scale + torch.einsum(
            "nhc,cd->nhd", p[..., P:], Kd[:, :512])
        out[q0:q1] = o.reshape(n, H * 512)
    return out


def check_case(i, case):
    """One correctness case against the float64 reference, at two (k_scale, v_scale) pairs: (all good,
    one row a pair)."""
    B, H, n, pl, mk, md, qd = case
    a = make_batch(B, H, n, pl, mask_kind=mk, mask_dtype=md or torch.uint8, qo_dtype=qd, seed=100 + i)
    ok, rows = True, []
    for ks, vs in ((1.0, 1.0), (0.7, 1.3)):  # noqa: B007
        out = torch.full((B * n, H * 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        verify_attention(**a, out=out, k_scale=ks, v_scale=vs)
        torch.cuda.synchronize()
        ref = reference(a, ks, vs)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        finite = bool(torch.isfinite(out).all())
        good = finite and err < 1e-2
        ok &= good
        rows.append(dict(B=B, H=H, n=n, prefix=pl, mask=mk, k_scale=ks, v_scale=vs, rel_err=err, finite=finite))
        print(f"{'ok ' if good else 'BAD'} {os.environ.get('KDTREE_KERNEL', 'auto')} B={B} H={H} n={n} prefix={pl[:4]} "
              f"mask={mk} ks={ks} vs={vs} rel_err={err:.2e} finite={finite}", flush=True)
    return ok, rows


def correctness(small=False, configs=("auto",)):
    """The cases below on every kernel path in `configs` (the paths timed after them: an A/B of a
    portable variant checks the portable kernel, not the GPU's default path)."""
    cases = [
        (1, 8, 16, [1000], "tree", torch.uint8, torch.int32),
        (3, 1, 3, [0, 5, 37], "tree", torch.bool, torch.int64),
        (2, 16, 33, [129, 1], "chain", torch.uint8, torch.int64),
        (2, 8, 5, [70, 0], "none", None, torch.int32),
        (1, 128, 64, [300], "tree", torch.uint8, torch.int32),
        (4, 64, 16, [17, 4096, 33, 700], "tree", torch.bool, torch.int32),
        (5, 3, 7, [1, 1, 1, 1, 1], "tree", torch.uint8, torch.int64),
        (1, 8, 16, [20000], "tree", torch.uint8, torch.int32),
        # DDTree-sized trees: 17 row tiles leave idle SMs (s3's extra CTAs), one request and a batch
        (1, 8, 129, [5000], "tree", torch.uint8, torch.int32),
        (3, 16, 65, [4000, 70, 2500], "tree", torch.uint8, torch.int32),
    ]
    if small:  # sized for compute-sanitizer: a few tiles, every code path (splits, draft tiles, masks)
        cases = [(2, 8, 5, [40, 0], "tree", torch.uint8, torch.int32), (1, 3, 17, [300], "none", None, torch.int64),
                 (3, 2, 3, [1, 33, 2], "chain", torch.bool, torch.int32),
                 # issue 26: small versions of the DDTree grid: drafts above 64, H·n not a multiple of
                 # the 64-row tile (520, 516 rows), H = 64 with 33 drafts (where racecheck reported)
                 (1, 8, 65, [70], "tree", torch.uint8, torch.int32), (2, 4, 129, [10, 90], "tree", torch.bool, torch.int64),
                 (1, 64, 33, [40], "tree", torch.uint8, torch.int32)]
    rows = []
    ok = True
    for cfg in configs:
        with kernel_path(cfg):
            for i, case in enumerate(cases):
                good, case_rows = check_case(i, case)
                ok &= good
                rows += [dict(config=cfg, **r) for r in case_rows]
    return ok, rows


def time_graph(fn, iters=50):
    """Median per-replay time of a captured graph, replays back to back (no host gap, clocks up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(max(3, iters // 5)):
        g.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        g.replay()
        events[i + 1].record()
    events[-1].synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) * 1000 for i in range(iters))


def timings(with_triton=True, configs=("auto",), shapes=None, slots="random"):
    shapes = shapes or [(1, 8, 16, 1024), (1, 8, 16, 8192), (8, 8, 16, 8192), (32, 8, 16, 8192), (1, 8, 16, 32768),
              (32, 16, 64, 8192), (8, 16, 64, 32768), (1, 8, 8, 32768), (32, 8, 8, 32768),
              # plans of at most two parts a request, uniform and ragged (L: the prefixes; one long
              # request cut over many parts): the merge's cost (journal s2), the grid's idle SMs (s3)
              (32, 8, 64, 1024), (8, 16, 64, 1024), (8, 8, 65, 8192), (8, 8, 65, [32768] + [1024] * 7),
              (8, 8, 65, [1024, 2048, 3072, 4096, 6144, 8192, 16384, 32768]), (32, 8, 64, [32768] + [1024] * 31)]
    if with_triton:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    res = []
    for B, H, n, L in shapes:
        prefixes = L if isinstance(L, list) else [L] * B
        L = max(prefixes)
        a = make_batch(B, H, n, prefixes, seed=7, pool_extra=L, slots=slots)
        out = torch.empty(B * n, H * 512, dtype=torch.bfloat16, device="cuda")
        t_cfg = {}
        for cfg in configs:
            with kernel_path(cfg):
                t_cfg[cfg] = time_graph(lambda: verify_attention(**a, out=out))
        t_ours = t_cfg[configs[0]]
        t_tri = float("nan")
        if with_triton:
            v = a["k"][..., :512].contiguous()
            o2 = torch.empty(B * n, H, 512, dtype=torch.bfloat16, device="cuda")
            kvb = a["kv_cache"]

            def tri():
                extend_attention_fwd(a["q"], a["k"], v, o2, kvb, kvb[..., :512], a["qo_indptr"], a["kv_indptr"],
                                     a["kv_indices"], a["custom_mask"], True, a["mask_indptr"], n, 1.0, 1.0,
                                     a["sm_scale"])
            t_tri = time_graph(tri, iters=10)
            d = ((o2.reshape(B * n, -1).double() - out.double()).norm() / out.double().norm()).item()
        else:
            d = float("nan")
        flops = 2 * n * H * sum(x + n for x in prefixes) * 1088
        byts = sum(x + n for x in prefixes) * 1152 + B * n * H * (1152 + 1024)
        ragged = len(set(prefixes)) > 1
        row = dict(B=B, H=H, n=n, L=L, prefixes=prefixes if ragged else None, slots=slots, ours_us=t_ours, triton_us=t_tri,
                   speedup=t_tri / t_ours,
                   tflops=flops / t_ours / 1e6, tbps=byts / t_ours / 1e6, diff_vs_triton=d,
                   by_config={str(c): t for c, t in t_cfg.items()})
        res.append(row)
        print(f"B={B:<3} H={H:<3} n={n:<3} L={L:<6}{' ragged' if ragged else ''} ours {t_ours:9.1f} us  "
              f"triton {t_tri:9.1f} us  "
              f"x{t_tri / t_ours:6.1f}  {row['tflops']:6.1f} TF/s  {row['tbps']:5.2f} TB/s  diff {d:.1e}  "
              + " ".join(f"{c}={t:.1f}us/{flops / t / 1e6:.0f}TF" for c, t in t_cfg.items()), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--small", action="store_true", help="small correctness cases only (for compute-sanitizer)")
    ap.add_argument("--profile-shape", help="B,H,n,L: run the op a few times on one shape (for ncu) and exit")
    ap.add_argument("--sweep-min-keys", action="store_true",
                    help="time small-batch shapes for several KDTREE_MIN_KEYS_PER_SPLIT values and exit")
    ap.add_argument("--configs", default="auto",
                    help="KDTREE_KERNEL values to time, e.g. portable,hopper")
    ap.add_argument("--shapes", help="'B,H,n,L;...': time these uniform shapes instead of the built-in list")
    ap.add_argument("--slots", choices=SLOT_ORDERS, default="random",
                    help="the timed batches' prefix slots: random (default), contiguous or runs of 1-300")
    args = ap.parse_args()
    t0 = time.time()
    if args.profile_shape:
        _, a = shape_batch(args.profile_shape, seed=3)
        for _ in range(3):
            verify_attention(**a)
        torch.cuda.synchronize()
        return 0
    if args.sweep_min_keys:
        from kdtree_backend.kernel import ops

        for B, H, n, L in ((1, 8, 16, 1024), (1, 8, 16, 8192), (1, 8, 16, 32768), (1, 16, 64, 8192),
                           (8, 8, 16, 1024), (1, 8, 8, 32768)):
            a = make_batch(B, H, n, [L] * B, seed=5, pool_extra=L)
            out = torch.empty(B * n, H * 512, dtype=torch.bfloat16, device="cuda")
            row = []
            for mk in (32, 64, 128, 256, 512, 1024):
                os.environ["KDTREE_MIN_KEYS_PER_SPLIT"] = str(mk)
                ops._plans.clear()
                row.append(f"{mk}:{time_graph(lambda: verify_attention(**a, out=out)):.1f}")
            print(f"min_keys sweep B={B} H={H} n={n} L={L}: " + "  ".join(row), flush=True)
        os.environ.pop("KDTREE_MIN_KEYS_PER_SPLIT", None)
        return 0
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    # "auto" (the default) leaves KDTREE_KERNEL as the caller set it: run.py sanitize picks --small's path so.
    ok, corr = correctness(args.small, configs)
    shapes = [shape_arg(x) for x in args.shapes.split(";") if x.strip()] if args.shapes else None
    tim = [] if args.small else timings(not args.no_triton, configs, shapes, args.slots)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), correctness=corr, timings=tim), f, indent=1)
    print(f"smoke {'PASSED' if ok else 'FAILED'} in {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
