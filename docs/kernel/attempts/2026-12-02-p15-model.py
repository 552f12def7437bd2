"""Random-interleaving model of p15's K pipeline protocol (portable/kernel.cuh KPipeline), to check the
phase arithmetic and the hand-offs before a GPU runs it: 8 warps, pairs (2g, 2g+1) share the exchange
barriers; mbarriers modelled by completed-phase counts with parity waits; copies complete later."""
import random, sys

def run(T, Pt, seed, W=8):
    rng = random.Random(seed)
    full = [dict(c=0, arr=0, tx=0) for _ in range(2)]
    stage_content_pending = [None, None]
    ids = [dict(c=0, arr=0) for _ in range(2)]
    stage = [None, None]          # tile id whose rows are in the stage (after its copy lands)
    ring = [None, None]           # tile id whose ids are in the ring entry (after cp.async lands)
    released = [0, 0]
    readers = [set(), set()]      # warps that waited on the stage's current tile and not yet released it
    pending = []                  # async events: (kind, payload)
    exch = {}                     # (barrier id, generation) arrivals
    log = []

    def mbar_ok(b, parity, k):
        ok = (b['c'] & 1) != parity
        if ok: assert b['c'] in (k + 1,), f"phase aliasing: completed {b['c']}, waited for use {k}"
        return ok

    def arrive_full(s, tx):
        b = full[s]; b['arr'] += 1; b['tx'] += tx
        check_full(s)
    def check_full(s):
        b = full[s]
        if b['arr'] == 32 and b['tx'] == 0:
            b['c'] += 1; b['arr'] = 0
            stage[s] = stage_content_pending[s]
    def issue(tile):
        s = tile & 1
        assert not readers[s], f"tile {tile} overwrites stage {s} still read by {readers[s]}"
        if tile < Pt:
            assert ring[s] == tile, f"issuing tile {tile} with ring entry holding {ring[s]}"
        stage_content_pending[s] = tile
        # 32 lanes: some valid (copy), some invalid (zero + plain arrive)
        nvalid = rng.choice([32, 32, 17, 0])
        for _ in range(32 - nvalid): arrive_full(s, 0)
        for _ in range(nvalid):
            full[s]['tx'] += 1152; full[s]['arr'] += 1
            pending.append(('copy', (s, tile)))
        check_full(s)
    def stage_ids(tile, with_bar):
        e = tile & 1
        for _ in range(32):
            pending.append(('ids', (e, tile, with_bar)))
    # prologue
    if 0 < Pt: ring[0] = 0
    if 1 < T and 1 < Pt: ring[1] = 1
    issue(0)
    if 1 < T: issue(1)
    if 2 < T and 2 < Pt: stage_ids(2, True)

    def warp_prog(w):
        g = w // 2
        for t in range(T):
            s = t & 1
            k = t >> 1
            while not mbar_ok(full[s], k & 1, k): yield 'wait'
            assert stage[s] == t, f"warp {w} reads stage {s} = {stage[s]} for tile {t}"
            readers[s].add(w)
            yield 'qk'
            # exchange: written barrier, then read-done barrier with partner
            for bid in (1 + g, 5 + g):
                key = (bid, t)
                exch[key] = exch.get(key, 0) + 1
                while exch[key] < 2: yield 'bar'
            yield 'pv'
            readers[s].discard(w)
            nxt = t + 2
            if nxt >= T: continue
            released[s] += 1
            if released[s] % W != 0: continue
            if nxt < Pt:
                kk = (nxt - 2) >> 1
                while not mbar_ok(ids[s], kk & 1, kk): yield 'idswait'
            issue(nxt)
            if nxt + 1 < T and nxt + 1 < Pt:
                stage_ids(nxt + 1, True)
            yield 'issued'
    progs = {w: warp_prog(w) for w in range(W)}
    done = set()
    steps = 0
    while len(done) < W:
        steps += 1
        if steps > 200000: raise AssertionError("no progress (deadlock?)")
        choices = [('w', w) for w in progs if w not in done] + [('e', i) for i in range(len(pending))]
        kind, x = rng.choice(choices)
        if kind == 'e':
            ev, pl = pending.pop(x)
            if ev == 'copy':
                s, tile = pl
                full[s]['tx'] -= 1152; check_full(s)
            else:
                e, tile, with_bar = pl
                ring[e] = tile
                b = ids[e]; b['arr'] += 1
                if b['arr'] == 32: b['c'] += 1; b['arr'] = 0
        else:
            try: next(progs[x])
            except StopIteration: done.add(x)
    # all async work drained and consumed
    assert all(ev != 'copy' for ev, _ in pending)
    return steps

n = 0
for T in list(range(1, 12)) + [17, 40]:
    for Pt in range(0, T + 2):
        for seed in range(40):
            run(T, Pt, seed); n += 1
print("ok", n, "runs")
