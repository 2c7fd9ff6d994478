"""The correction's kernels on head-major and token-major sources (the serving record now holds the
engine's read-back as it is: token-major), the served trace's shapes: SmolLM2-135M's 30 layers x 3 kv
heads x 64, a 1,024-token document, 4 rank-32 anchors. Best of 3 / 7 runs each, two rounds.

    OMP_NUM_THREADS=1 python docs/results/correction_layout.py
"""

import time, torch
from hf_kvshare.anchors.correction import token_distances, apply_correction
from hf_kvshare.anchors.lowrank import FactoredKV
from hf_kvshare.anchors.pool import Anchor
from hf_kvshare.cache import SegmentKV
from hf_kvshare.rope import RopeShifter
torch.manual_seed(0)
L, H, D, S, r, n = 30, 3, 64, 1024, 32, 4
shifter = RopeShifter(inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
def fk():
    return FactoredKV.from_kv([torch.randn(1, H, S, D) for _ in range(L)], [torch.randn(1, H, S, D) for _ in range(L)], r, "randomized")
anchors = []
for i in range(n):
    a = Anchor(base=fk(), source="s", origin=i, frame="writer"); a.deltas["a"] = fk(); anchors.append(a)
head = SegmentKV(keys=[torch.randn(1, H, S, D) for _ in range(L)], values=[torch.randn(1, H, S, D) for _ in range(L)], start=40)
bk, bv = torch.stack([k[0].transpose(0, 1) for k in head.keys]), torch.stack([v[0].transpose(0, 1) for v in head.values])
token = SegmentKV(keys=[k.transpose(0, 1)[None] for k in bk], values=[v.transpose(0, 1)[None] for v in bv], start=40)
kd, vd = token_distances(head, anchors, shifter, S)
w, wv = torch.softmax(-kd, 0).float(), torch.softmax(-vd, 0).float()
def best(f, k=7):
    b = 1e9
    for _ in range(k):
        t = time.perf_counter(); f(); b = min(b, time.perf_counter() - t)
    return b * 1e3
for rnd in range(2):
    for name, src in (("head-major", head), ("token-major", token)):
        td = best(lambda: token_distances(src, anchors, shifter, S), 3)
        ac = best(lambda: apply_correction(src, anchors, "a", w, wv, 60, shifter, skip_layer0=True))
        rp = best(lambda: src.repositioned(shifter, 60))
        print(f"{name:12} token_distances {td:6.1f} ms  apply_correction {ac:6.1f} ms  repositioned {rp:6.1f} ms")
