"""Exact batched linear assignment on the device, for the DETR Hungarian matcher.

Algorithm: the shortest-augmenting-path Hungarian method (Jonker-Volgenant / Crouse, the algorithm behind
``scipy.optimize.linear_sum_assignment``), vectorised over P problems. Targets are rows, queries are columns.

1. Sanitize NaN/inf like rfdetr, then row-reduce (``C - min_q C``): the optimum does not change, float32 keeps more
   digits. Costs live as ``[P, T, Q]`` float32.
2. Warm start: up to ``auction_rounds`` Jacobi auction rounds with zero epsilon (JV's "augmenting row reduction",
   all free targets at once). They keep the Hungarian invariants exactly (reduced costs >= 0 where assigned, assigned
   pairs tight, query duals ``v <= 0`` and 0 on free queries), so nothing they do can cost optimality; they only
   assign most targets in a few dense passes.
3. Every still-free target is inserted by a Dijkstra search over reduced costs ``C - u - v`` (SciPy's dual update);
   one loop round scans one column per problem, or flips one edge of the augmenting path once a free query is found.
4. The loops are XLA ``While`` ops (built with ``torch_xla.core.xla_builder``, like ``torch_xla.experimental.scan``)
   that stop when every problem is done, so a batch costs as many rounds as its hardest problem needs. In eager
   PyTorch the same bodies run in a Python loop.

No tolerance enters the search: the result is optimal up to float32 rounding. ``converged`` also checks the dual
certificate within ``eps`` (relative to the duals' magnitude). A problem that runs out of ``max_rounds`` keeps its
(injective) partial matching and the rest is filled greedily: two rounds of "each free target proposes its cheapest
free query, the cheapest proposer wins", then the k-th leftover target takes the k-th free query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from spmd_rfdetr.xla.while_loop import while_loop

__all__ = ["AssignmentResult", "sanitize_cost", "solve_assignment", "solve_assignment_with_stats"]

#: Reduced costs are clamped here so that sums along alternating paths stay finite in float32.
_BIG = 1.0e30
#: Warm-start auction rounds (each one pass over the whole cost; they cut the sequential search rounds several-fold).
_AUCTION_ROUNDS = 4
#: Greedy proposal rounds used to finish problems that ran out of rounds.
_GREEDY_ROUNDS = 2
#: Margin added to the sentinel that replaces non-finite costs (rfdetr's ``_SANITIZED_COST_MARGIN``).
_SANITIZED_COST_MARGIN = 1.0


class AssignmentResult(NamedTuple):
    """What :func:`solve_assignment_with_stats` returns."""

    query_of_target: Tensor  # [P, T] int64, 0 for invalid slots
    converged: Tensor  # [P] bool
    rounds: Tensor  # [P] int64: loop iterations each problem was active
    iterations: Tensor  # [] int64: loop iterations run (the batch's maximum, or max_rounds)


def sanitize_cost(cost: Tensor, valid: Tensor) -> Tensor:
    """Replace NaN/inf in ``cost [P, Q, T]`` per problem, like rfdetr's ``HungarianMatcher._sanitize_cost_matrix``.

    The sentinel is ``max + max|.| + 1`` over the problem's finite entries in valid target columns (clamped to the
    largest finite float); a problem without any finite entry uses the largest finite float. Upstream computes one
    sentinel over the whole batch matrix, and only when something is non-finite; per problem is the batched analogue
    and gives the same assignment whenever a problem's optimum avoids non-finite entries.
    """
    if cost.numel() == 0:
        return cost
    fmax = torch.finfo(cost.dtype).max
    finite = torch.isfinite(cost) & valid[:, None, :]
    masked = torch.where(finite, cost, torch.zeros_like(cost))
    max_cost = torch.where(finite, cost, torch.full_like(cost, -fmax)).amax(dim=(1, 2))
    max_abs = masked.abs().amax(dim=(1, 2))
    sentinel = torch.clamp(max_cost + max_abs + _SANITIZED_COST_MARGIN, max=fmax)
    sentinel = torch.where(finite.any(dim=2).any(dim=1), sentinel, torch.full_like(sentinel, fmax))
    return torch.where(torch.isfinite(cost), cost, sentinel[:, None, None].expand_as(cost))


def solve_assignment(
    cost: Tensor, valid: Tensor, *, max_rounds: int | None = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """Exact min-cost matching of the valid targets of each problem to distinct queries.

    Args:
        cost: ``[P, Q, T]`` float: P problems, Q queries, T padded target slots.
        valid: ``[P, T]`` bool: which target slots are real (at most Q per problem).
        max_rounds: loop budget (one Dijkstra scan or one path flip per problem per round). ``None`` means the
            worst case ``T * (T + 1)``, which always suffices; the loop stops early once every problem is done.
        eps: relative tolerance of the optimality certificate reported in ``converged``.

    Returns:
        ``(query_of_target [P, T] int64, converged [P] bool)``: for every valid target the query it is assigned to,
        injective within a problem and minimising the total cost as ``scipy.optimize.linear_sum_assignment`` would
        on ``cost[p][:, valid[p]]``; 0 for invalid slots. ``converged[p]`` is False when the budget ended first
        (the rest was filled greedily) or the certificate failed.
    """
    result = solve_assignment_with_stats(cost, valid, max_rounds=max_rounds, eps=eps)
    return result.query_of_target, result.converged


@torch.no_grad()
def solve_assignment_with_stats(
    cost: Tensor,
    valid: Tensor,
    *,
    max_rounds: int | None = None,
    eps: float = 1e-5,
    auction_rounds: int = _AUCTION_ROUNDS,
) -> AssignmentResult:
    """:func:`solve_assignment` plus per-problem round counts (for tests and benchmarks).

    ``auction_rounds`` bounds the warm-start auction (each round costs one pass over ``[P, T, Q]``).
    """
    cost = cost.detach()
    num_problems, num_queries, num_targets = cost.shape
    device = cost.device
    valid = valid.to(device=device, dtype=torch.bool)
    # At most Q targets can be matched: surplus valid slots are dropped and their problem reported unconverged.
    fits = valid.to(torch.int32).cumsum(dim=1) <= num_queries
    overflow = (valid & ~fits).any(dim=1)
    valid = valid & fits
    if max_rounds is None:
        max_rounds = num_targets * (num_targets + 1)
    if num_targets == 0 or num_problems == 0 or num_queries == 0:
        zero = torch.zeros(num_problems, dtype=torch.int64, device=device)
        return AssignmentResult(torch.zeros_like(valid, dtype=torch.int64), ~overflow, zero, zero.sum())

    reduced = _reduced_cost(cost, valid)

    def searching(*state: Tensor) -> Tensor:
        return (state[_CUR] < num_targets).any() & (state[_IT] < max_rounds)

    state = while_loop(searching, _step, _initial_state(reduced, valid, auction_rounds))
    col4row, done = state[_COL4ROW], state[_CUR] >= num_targets
    certified = _certified(valid, state[_U], state[_V], col4row, reduced, eps)

    # Greedy completion runs (as a 0- or 1-trip loop) only when some problem ran out of rounds.
    def pending(cost: Tensor, valid: Tensor, col4row: Tensor, first: Tensor) -> Tensor:
        return first & (valid & (col4row == num_queries)).any()

    def finish(cost: Tensor, valid: Tensor, col4row: Tensor, first: Tensor) -> tuple[Tensor, ...]:
        return cost, valid, _greedy_finish(cost, valid, col4row), torch.zeros_like(first)

    first = torch.ones((), dtype=torch.bool, device=device)
    col4row = while_loop(pending, finish, (reduced, valid, col4row, first))[2]
    query_of_target = torch.where(valid, col4row, torch.zeros_like(col4row)).long()
    converged = done & certified & ~overflow
    return AssignmentResult(query_of_target, converged, state[_ROUNDS].long(), state[_IT].long())


def _reduced_cost(cost: Tensor, valid: Tensor) -> Tensor:
    """``sanitize_cost`` then row reduction, as float32 ``[P, T, Q]`` (rows = targets; invalid rows are 0).

    Same numbers as ``sanitize_cost(cost) - min over queries``, but from per-target statistics, so the big tensor is
    read once and written once.
    """
    cost = cost.float()
    fmax = torch.finfo(cost.dtype).max
    finite = torch.isfinite(cost)
    low = torch.where(finite, cost, torch.full_like(cost, float("inf"))).amin(dim=1)  # [P, T]
    high = torch.where(finite, cost, torch.full_like(cost, float("-inf"))).amax(dim=1)
    any_finite = valid & (low <= high)
    max_cost = torch.where(any_finite, high, torch.full_like(high, -fmax)).amax(dim=1)  # [P]
    max_abs = torch.where(any_finite, torch.maximum(high.abs(), low.abs()), torch.zeros_like(high)).amax(dim=1)
    sentinel = torch.clamp(max_cost + max_abs + _SANITIZED_COST_MARGIN, max=fmax)
    sentinel = torch.where(any_finite.any(dim=1), sentinel, torch.full_like(sentinel, fmax))[:, None, None]
    row_min = torch.where(low <= high, low, sentinel[:, :, 0].expand_as(low))  # sentinel > every finite entry
    reduced = torch.where(finite, cost, sentinel) - row_min[:, None, :]
    reduced = torch.where(valid[:, None, :], reduced, torch.zeros_like(reduced))
    return torch.clamp(reduced, min=0.0, max=_BIG).transpose(1, 2).contiguous()


# Positions in the loop state (a flat tuple of tensors, as an XLA While carries it).
(_C, _VALID, _U, _V, _COL4ROW, _ROW4COL, _CUR, _I, _D, _PRED, _SC, _MINVAL, _SINK, _ROUNDS, _IT) = range(15)
_INDEX = torch.int32  # index dtype of the loop state


def _first_true(mask: Tensor, none: int) -> Tensor:
    """Index (int32) of the first True along the last dim, or ``none`` where there is none."""
    first = mask.to(torch.int32).argmax(dim=-1).to(_INDEX)
    return torch.where(mask.any(dim=-1), first, torch.full_like(first, none))


def _take(values: Tensor, index: Tensor) -> Tensor:
    """``values[p, index[p]]`` for ``values [P, N]`` and ``index [P]``."""
    return pick_values(values, index[:, None])[:, 0]


def pick_values(values: Tensor, index: Tensor) -> Tensor:
    """``values[p, index[p, t]]`` for ``values [P, N]`` and ``index [P, T]`` (0 where ``index`` is ``N``).

    On XLA a one-hot select and sum over ``N`` (exact: one term is not zero), which the TPU runs as one fused pass over
    ``values`` where an element-wise gather costs a memory tile per element (the loops run it every round); eager
    tensors take ``torch.gather`` (the same values; the one-hot's ``[P, T, N]`` would be built op by op)."""
    if values.device.type != "xla":
        padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)
        return padded.gather(1, index.long().clamp(0, values.shape[1]))
    hit = index[:, :, None] == torch.arange(values.shape[1], device=values.device, dtype=index.dtype)
    return torch.where(hit, values[:, None, :], torch.zeros_like(values[:, None, :])).sum(dim=2, dtype=values.dtype)


def _row(values: Tensor, row: Tensor) -> Tensor:
    """``values[p, row[p], :]`` for ``values [P, T, N]`` and ``row [P]``; on XLA a one-hot select and sum over ``T``
    (exact): one fused pass over ``values`` on a TPU (a row lookup of ``[P * T, N]`` was 2.4x its bytes, priced alone by
    libtpu, and the flattening a copy: the TPU tiles ``T`` in 8s); eager tensors take ``torch.gather``."""
    if values.device.type != "xla":
        return values.gather(1, row.long()[:, None, None].expand(values.shape[0], 1, values.shape[2]))[:, 0]
    hit = torch.arange(values.shape[1], device=values.device, dtype=row.dtype) == row[:, None]
    return torch.where(hit[:, :, None], values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=1)


def _initial_state(cost: Tensor, valid: Tensor, auction_rounds: int) -> tuple[Tensor, ...]:
    """Warm start from a few exact auction rounds, then an idle search state for the first unassigned row."""
    num_problems, num_targets, num_queries = cost.shape
    device = cost.device
    v = torch.zeros((num_problems, num_queries), dtype=cost.dtype, device=device)
    col4row = torch.full((num_problems, num_targets), num_queries, dtype=_INDEX, device=device)
    row4col = torch.full((num_problems, num_queries), num_targets, dtype=_INDEX, device=device)
    round_ = torch.zeros((), dtype=_INDEX, device=device)

    def more(cost: Tensor, valid: Tensor, v: Tensor, col4row: Tensor, row4col: Tensor, k: Tensor) -> Tensor:
        return (k < auction_rounds) & (valid & (col4row == num_queries)).any()

    def bid(cost: Tensor, valid: Tensor, v: Tensor, col4row: Tensor, row4col: Tensor, k: Tensor) -> tuple[Tensor, ...]:
        return (cost, valid, *_auction_round(cost, valid, v, col4row, row4col), k + 1)

    _, _, v, col4row, row4col, _ = while_loop(more, bid, (cost, valid, v, col4row, row4col, round_))
    held = col4row.clamp(max=num_queries - 1).long()
    u = cost.gather(2, held[:, :, None])[:, :, 0] - v.gather(1, held)  # tight on assigned rows
    u = torch.where(col4row < num_queries, u, torch.zeros_like(u))
    cur = _first_true(valid & (col4row == num_queries), num_targets)
    return (
        cost,
        valid,
        u,
        v,
        col4row,
        row4col,
        cur,
        cur.clone(),  # i: row scanned next
        torch.full((num_problems, num_queries), float("inf"), dtype=cost.dtype, device=device),  # d
        torch.full((num_problems, num_queries), num_targets, dtype=_INDEX, device=device),  # pred
        torch.zeros((num_problems, num_queries), dtype=torch.bool, device=device),  # scanned columns
        torch.zeros(num_problems, dtype=cost.dtype, device=device),  # minval
        torch.full((num_problems,), num_queries, dtype=_INDEX, device=device),  # sink (Q: not flipping)
        torch.zeros(num_problems, dtype=_INDEX, device=device),  # rounds
        torch.zeros((), dtype=_INDEX, device=device),  # iteration
    )


def _auction_round(
    cost: Tensor, valid: Tensor, v: Tensor, col4row: Tensor, row4col: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One Jacobi auction round with zero epsilon (JV's augmenting row reduction, all free rows at once).

    Every free row bids for its best column ``j1`` (by ``cost - v``) the gap to its second best; per column the
    highest bid wins (ties: lowest row), evicting the previous holder, and ``v[j1]`` drops by the bid. This keeps the
    Hungarian invariants: reduced costs >= 0 on assigned rows, assigned pairs tight, ``v <= 0``, free columns at 0.
    """
    num_problems, num_targets, num_queries = cost.shape
    device = cost.device
    rows = torch.arange(num_targets, device=device, dtype=_INDEX).expand(num_problems, -1)
    cols = torch.arange(num_queries, device=device)
    free = valid & (col4row == num_queries)
    value = cost - v[:, None, :]
    best, j1 = value.min(dim=2)  # [P, T]
    second = torch.where(cols == j1[:, :, None], torch.full_like(value, float("inf")), value).amin(dim=2)
    gain = torch.clamp(second - best, max=_BIG)
    won = _winners(free, j1, gain, "amax", num_queries)
    won_col = torch.where(won, j1, torch.full_like(j1, num_queries))
    drop = torch.zeros((num_problems, num_queries + 1), dtype=cost.dtype, device=device)
    drop = drop.scatter_add(1, won_col, torch.where(won, gain, torch.zeros_like(gain)))
    owner = torch.full((num_problems, num_queries + 1), num_targets, dtype=_INDEX, device=device)
    owner = owner.scatter(1, won_col, rows)[:, :num_queries]
    taken = owner < num_targets
    loser = torch.where(taken, row4col, torch.full_like(row4col, num_targets)).long()
    evicted = torch.zeros((num_problems, num_targets + 1), dtype=torch.bool, device=device)
    evicted = evicted.scatter(1, loser, torch.ones_like(taken))[:, :num_targets]
    col4row = torch.where(evicted, torch.full_like(col4row, num_queries), col4row)
    col4row = torch.where(won, j1.to(_INDEX), col4row)
    return v - drop[:, :num_queries], col4row, torch.where(taken, owner, row4col)


def _step(*s: Tensor) -> tuple[Tensor, ...]:
    """One round: a Dijkstra scan for searching problems, then one path flip for problems holding a sink."""
    cost, valid, u, v, col4row, row4col, cur, i, d, pred, sc, minval, sink, rounds, it = s
    num_problems, num_targets, num_queries = cost.shape
    device = cost.device
    cols = torch.arange(num_queries, device=device, dtype=_INDEX)
    rows = torch.arange(num_targets, device=device, dtype=_INDEX)
    inf = torch.full_like(d, float("inf"))
    active = cur < num_targets
    searching = active & (sink == num_queries)

    # Scan row i: relax the unscanned columns, then take the closest one (a free one on ties, like SciPy).
    row = i.clamp(max=num_targets - 1)
    cost_row = _row(cost, row)  # [P, Q]
    cand = (minval - _take(u, row))[:, None] + cost_row - v
    relax = searching[:, None] & ~sc & (cand < d)
    d = torch.where(relax, cand, d)
    pred = torch.where(relax, row[:, None], pred)
    open_d = torch.where(sc, inf, d)
    low = open_d.amin(dim=1)
    free = row4col == num_targets
    score = (open_d == low[:, None]).to(torch.int32) * (1 + free.to(torch.int32))
    j = score.argmax(dim=1).to(_INDEX)
    sc = sc | ((cols == j[:, None]) & searching[:, None])
    owner = _take(row4col, j)
    found = searching & (owner == num_targets)
    extend = searching & (owner != num_targets)
    i = torch.where(extend, owner, i)
    minval = torch.where(extend, low, minval)

    # Reached a free column: dual update exactly as SciPy does (columns scanned this search, their rows, cur).
    delta = torch.where(sc & found[:, None], low[:, None] - d, torch.zeros_like(d))
    v = v - delta
    u = u + pick_values(delta, col4row)  # free rows (col4row = Q) get 0
    u = u + torch.where(found[:, None] & (rows == cur[:, None]), low[:, None], torch.zeros_like(u))
    sink = torch.where(found, j, sink)

    # Flip one edge of the alternating path, walking back from the sink.
    flipping = active & (sink < num_queries)
    col = sink.clamp(max=num_queries - 1)
    prev_row = _take(pred, col).clamp(max=num_targets - 1)
    prev_col = _take(col4row, prev_row)
    row4col = torch.where(flipping[:, None] & (cols == col[:, None]), prev_row[:, None], row4col)
    col4row = torch.where(flipping[:, None] & (rows == prev_row[:, None]), col[:, None], col4row)
    sink = torch.where(flipping, prev_col, sink)  # cur was unassigned, so its old column is Q: path done
    finished = flipping & (prev_row == cur)

    # Start the next unassigned row with a fresh search.
    nxt = _first_true(valid & (col4row == num_queries), num_targets)
    cur = torch.where(finished, nxt, cur)
    i = torch.where(finished, nxt, i)
    d = torch.where(finished[:, None], inf, d)
    sc = sc & ~finished[:, None]
    minval = torch.where(finished, torch.zeros_like(minval), minval)
    rounds = rounds + active.to(_INDEX)
    return (cost, valid, u, v, col4row, row4col, cur, i, d, pred, sc, minval, sink, rounds, it + 1)


def _certified(valid: Tensor, u: Tensor, v: Tensor, col4row: Tensor, cost: Tensor, eps: float) -> Tensor:
    """Dual certificate within ``tol = eps * (1 + max|u| + max|v|)`` (the scale of the duals' rounding error).

    Checks reduced costs ``>= -tol`` on valid rows, assigned pairs tight, ``v <= tol`` and free columns at
    ``|v| <= tol``; together these bound the total's distance from the optimum by about ``2 * T * tol``.
    """
    num_queries = cost.shape[2]
    u = torch.where(valid, u, torch.zeros_like(u))
    tol = eps * (1.0 + u.abs().amax(dim=1) + v.abs().amax(dim=1))
    slack_min = (cost - u[:, :, None] - v[:, None, :]).amin(dim=2)  # [P, T]
    held = col4row.clamp(max=num_queries - 1).long()
    slack_held = cost.gather(2, held[:, :, None])[:, :, 0] - u - v.gather(1, held)
    assigned = col4row < num_queries
    row_ok = ~valid | (assigned & (slack_min >= -tol[:, None]) & (slack_held <= tol[:, None]))
    used = _used_columns(col4row, num_queries)
    col_ok = (v <= tol[:, None]) & (used | (v >= -tol[:, None]))
    return row_ok.all(dim=1) & col_ok.all(dim=1)


def _used_columns(col4row: Tensor, num_queries: int) -> Tensor:
    """``[P, Q]`` bool: columns some row holds (col4row uses Q for 'none')."""
    used = torch.zeros((col4row.shape[0], num_queries + 1), dtype=torch.int32, device=col4row.device)
    used = used.scatter(1, col4row.long(), torch.ones_like(col4row, dtype=torch.int32))
    return used[:, :num_queries] > 0


def _winners(bidding: Tensor, column: Tensor, key: Tensor, best: str, num_queries: int) -> Tensor:
    """``[P, T]`` bool: bidding rows whose ``key`` is the best (``"amax"``/``"amin"``) for their ``column``.

    Ties go to the lowest row, so each column has at most one winner.
    """
    num_problems, num_targets = column.shape
    rows = torch.arange(num_targets, device=column.device, dtype=_INDEX).expand(num_problems, -1)
    spare = torch.full_like(column, num_queries)  # slot Q collects the rows that do not bid
    slot = torch.where(bidding, column, spare)
    worst = float("-inf") if best == "amax" else float("inf")
    top = torch.full((num_problems, num_queries + 1), worst, dtype=key.dtype, device=key.device)
    at_top = bidding & (key == pick_values(top.scatter_reduce(1, slot, key, best), slot))
    first = torch.full((num_problems, num_queries + 1), num_targets, dtype=_INDEX, device=key.device)
    first = first.scatter_reduce(1, torch.where(at_top, slot, spare), rows, "amin")
    return at_top & (pick_values(first, slot) == rows)


def _greedy_finish(cost: Tensor, valid: Tensor, col4row: Tensor) -> Tensor:
    """Give every still-unassigned valid row a distinct free column (a no-op for finished problems)."""
    num_problems, num_targets, num_queries = cost.shape
    for _ in range(_GREEDY_ROUNDS):
        need = valid & (col4row == num_queries)
        taken = _used_columns(col4row, num_queries)[:, None, :] | ~need[:, :, None]
        pick_cost, pick = torch.where(taken, torch.full_like(cost, 2 * _BIG), cost).min(dim=2)  # [P, T]
        won = _winners(need & (pick_cost <= _BIG), pick, pick_cost, "amin", num_queries)
        col4row = torch.where(won, pick.to(_INDEX), col4row)
    # Whatever is left: the k-th needy row takes the k-th free column.
    need = valid & (col4row == num_queries)
    free = ~_used_columns(col4row, num_queries)
    cols = torch.arange(num_queries, device=cost.device, dtype=_INDEX).expand(num_problems, -1)
    no_rank = torch.full((num_problems, 1), num_queries, dtype=torch.int64, device=cost.device)  # spare slot Q
    free_rank = torch.where(free, free.long().cumsum(dim=1) - 1, no_rank)
    col_of_rank = torch.full((num_problems, num_queries + 1), num_queries, dtype=_INDEX, device=cost.device)
    col_of_rank = col_of_rank.scatter(1, free_rank, cols)
    need_rank = torch.where(need, need.long().cumsum(dim=1) - 1, no_rank)
    return torch.where(need, pick_values(col_of_rank, need_rank), col4row)
