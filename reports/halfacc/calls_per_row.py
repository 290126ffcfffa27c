"""The failing positions case's plan, read off RingPlan::plan_explicit's rules:
whether each rank's kv positions are sorted (unsorted: one masked call per
256-row q tile per step), and for each q row the number of blocks holding a
key it sees (each gives the row one kernel-rounded partial gq)."""

import torch

for n in (2, 4):
    s = 20 * n + 3
    docs = torch.tensor([0, 7, 7 + 10 * n, s])
    kept = torch.tensor([p for p in range(s) if p not in docs[:-1].tolist()])
    kv = kept[torch.randperm(kept.numel(), generator=torch.Generator().manual_seed(5))]
    qs, ks = torch.arange(s).tensor_split(n), kv.tensor_split(n)
    print(
        f"n={n}: q rows per rank {[len(q) for q in qs]}, kv rows per rank "
        f"{[len(k) for k in ks]}, kv sorted per rank "
        f"{[bool((k[1:] >= k[:-1]).all()) for k in ks]}"
    )
    doc_of = lambda p: torch.bucketize(p, docs, right=True)  # noqa: E731
    for r, q in enumerate(qs):
        per_row = [
            sum(bool(((k <= p) & (doc_of(k) == doc_of(torch.tensor([p])))).any()) for k in ks)
            for p in q.tolist()
        ]
        print(f"  rank {r}: calls per step 1; blocks with a visible key per q row: {per_row}")
