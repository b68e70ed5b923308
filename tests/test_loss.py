"""The static-shape matcher: padding parking, and the same assignment as upstream's SciPy matcher."""

from __future__ import annotations

import torch
import torch_xla

from spmd_rfdetr.loss import park_padding


def test_padding_parks_on_distinct_free_queries_on_xla() -> None:
    # a real target on query 0: padding slots also index query 0, which a plain scatter may let win
    query = torch.tensor([[0, 5, 0, 0], [3, 0, 0, 0], [0, 1, 2, 3]])
    valid = torch.tensor([[True, True, False, False], [True, False, False, False], [True, True, True, True]])
    for device in ("cpu", torch_xla.device()):
        parked = park_padding(query.to(device), valid.to(device), num_queries=6).cpu()
        for row, mask, original in zip(parked, valid, query):
            assert len(set(row.tolist())) == 4, parked  # injective
            assert torch.equal(row[mask], original[mask])  # real targets keep their query
            free = sorted(set(range(6)) - set(original[mask].tolist()))
            assert row[~mask].tolist() == free[: int((~mask).sum())]  # lowest free queries, in order
