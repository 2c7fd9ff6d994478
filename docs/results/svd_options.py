"""How fast one layer set of anchor factorizations can be on this CPU: 30 matrices of 2,048 x 192
(a 2K-token segment of SmolLM2-135M: 3 KV heads x 64), rank 32, float32, one thread.

    OMP_NUM_THREADS=1 python docs/results/svd_options.py

Times (mean of 3, after one warm-up) the KVCMAS reference's randomized SVD
(``torch.svd_lowrank(q=32, niter=2)``) layer by layer (what ``anchors.lowrank`` runs), the same on the
30 matrices batched, the Gram matrix's ``eigh``, a batched randomized range finder written out, and
the exact ``torch.linalg.svd`` (one pass). Not a benchmark: run it alone on the machine.
"""

from __future__ import annotations

import time

import torch

torch.set_num_threads(1)
torch.manual_seed(0)
L, D, r, n = 2048, 192, 32, 30
ms = [torch.randn(L, 8) @ torch.randn(8, D) + 0.1 * torch.randn(L, D) for _ in range(n)]
stacked = torch.stack(ms)


def timed(f, reps=3):
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps


def gram():
    values, vectors = torch.linalg.eigh(stacked.transpose(1, 2) @ stacked)
    right = vectors[..., -r:].flip(-1)
    return stacked @ right, right.transpose(1, 2)


def range_finder():
    omega = torch.randn(D, r, generator=torch.Generator().manual_seed(0))
    y = stacked @ omega
    for _ in range(2):
        q, _ = torch.linalg.qr(y)
        q, _ = torch.linalg.qr(stacked.transpose(1, 2) @ q)
        y = stacked @ q
    q, _ = torch.linalg.qr(y)
    u, s, vh = torch.linalg.svd(q.transpose(1, 2) @ stacked, full_matrices=False)
    return (q @ u) * s[..., None, :], vh


print(f"svd_lowrank, layer by layer: {timed(lambda: [torch.svd_lowrank(m, q=r, niter=2) for m in ms]):.3f} s")
print(f"svd_lowrank, batched:        {timed(lambda: torch.svd_lowrank(stacked, q=r, niter=2)):.3f} s")
print(f"Gram + eigh, batched:        {timed(gram):.3f} s")
print(f"range finder, batched:       {timed(range_finder):.3f} s")
print(
    f"linalg.svd, layer by layer:  {timed(lambda: [torch.linalg.svd(m, full_matrices=False) for m in ms], 1):.3f} s"
)
