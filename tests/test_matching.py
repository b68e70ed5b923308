"""The on-device assignment solver against SciPy: exactness, degenerate inputs, one XLA graph, no host transfer.

The big sweep runs in eager CPU torch (the same code as on the device); a smaller batch goes through
``torch_xla.compile(..., full_graph=True)`` on the (SPMD, 4 virtual CPU devices) XLA device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from spmd_rfdetr.model.matching import sanitize_cost, solve_assignment, solve_assignment_with_stats
from spmd_rfdetr.model.matching_problems import SWEEP, Check, compare_with_scipy, detr_costs


def assert_exact(check: Check, *, strict_fraction: float = 0.999) -> None:
    """>= strict_fraction of problems within 1e-5 relative of SciPy's total, all within 1e-3, all injective."""
    assert check.injective.all(), f"{(~check.injective).sum()} problems not injective"
    assert (check.rel_err <= 1e-5).mean() >= strict_fraction, np.sort(check.rel_err)[-10:]
    assert check.rel_err.max() <= 1e-3, np.sort(check.rel_err)[-10:]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Eager CPU ops on small tensors: one thread avoids OpenMP stalls when other processes share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def solve_and_check(cost: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, Check]:
    """Solve, check the output contract, and compare with SciPy."""
    query_of_target, converged = solve_assignment(cost, valid)
    assert query_of_target.dtype == torch.int64 and query_of_target.shape == valid.shape
    assert (query_of_target[~valid] == 0).all()
    return converged, compare_with_scipy(cost, valid, query_of_target)


def mixed_batch(
    generator: torch.Generator, per_mode: int, num_queries: int, max_targets: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_mode`` problems of each of the random / trained / untrained kinds."""
    modes = ("random", "trained", "untrained")
    parts = [detr_costs(per_mode, num_queries, max_targets, generator, mode=mode) for mode in modes]
    return torch.cat([c for c, _ in parts]), torch.cat([v for _, v in parts])


def compiled_solver():
    """``solve_assignment`` as one XLA graph (raises if tracing produces more than one)."""
    import torch_xla

    return torch_xla.compile(lambda cost, valid: solve_assignment(cost, valid), full_graph=True)


@pytest.mark.slow
def test_exactness_sweep_eager() -> None:
    generator = torch.Generator().manual_seed(0)
    errors, total = [], 0
    for num_problems, num_queries, max_targets, mode, min_targets in SWEEP:
        cost, valid = detr_costs(num_problems, num_queries, max_targets, generator, mode=mode, min_targets=min_targets)
        result = solve_assignment_with_stats(cost, valid)
        check = compare_with_scipy(cost, valid, result.query_of_target)
        assert result.converged.all()
        assert check.injective.all()
        errors.append(check.rel_err)
        total += num_problems
    assert total >= 10_000
    assert_exact(Check(np.concatenate(errors), np.ones(total, dtype=bool)))


def test_no_targets() -> None:
    query_of_target, converged = solve_assignment(torch.randn(3, 5, 0), torch.zeros(3, 0, dtype=torch.bool))
    assert query_of_target.shape == (3, 0) and converged.all()
    cost = torch.randn(4, 6, 3)
    valid = torch.zeros(4, 3, dtype=torch.bool)
    valid[1, :2] = True
    converged, check = solve_and_check(cost, valid)
    assert converged.all() and (check.rel_err == 0).all()


def test_identical_targets_and_ties() -> None:
    generator = torch.Generator().manual_seed(1)
    column = torch.rand(64, 40, 1, generator=generator)
    identical = column.expand(64, 40, 12).contiguous()  # every target the same
    integer = torch.randint(0, 3, (64, 40, 12), generator=generator).float()  # heavy exact ties
    zeros = torch.zeros(8, 12, 12)
    for cost in (identical, integer, zeros):
        valid = torch.arange(12)[None, :] < torch.randint(0, 13, (len(cost),), generator=generator)[:, None]
        converged, check = solve_and_check(cost, valid)
        assert converged.all() and check.injective.all() and (check.rel_err == 0).all()


def test_cost_spanning_1e_minus_6_to_1e4() -> None:
    generator = torch.Generator().manual_seed(2)
    for num_queries, max_targets in ((300, 60), (30, 30)):
        # Entries log-uniform in 1e-6..1e4, and DETR costs (shifted positive) with a 1e-6..1e4 scale per target.
        entries = 10.0 ** (torch.rand(300, num_queries, max_targets, generator=generator) * 10.0 - 6.0)
        detr, valid = detr_costs(300, num_queries, max_targets, generator)
        per_target = 10.0 ** (torch.rand(300, 1, max_targets, generator=generator) * 10.0 - 6.0)
        for cost in (entries, (detr - detr.amin() + 1e-3) * per_target):
            converged, check = solve_and_check(cost, valid)
            assert converged.all()
            assert_exact(check)


def test_nan_and_inf_are_sanitized_like_rfdetr() -> None:
    from rfdetr.models.matcher import HungarianMatcher

    generator = torch.Generator().manual_seed(3)
    cost, valid = detr_costs(200, 30, 30, generator)
    bad = torch.rand(cost.shape, generator=generator)
    cost = torch.where(bad < 0.05, float("nan"), cost)
    cost = torch.where(bad > 0.97, float("inf"), cost)
    cost = torch.where((bad > 0.95) & (bad <= 0.97), float("-inf"), cost)
    cost[0, :, 0] = float("nan")  # a target no query can afford
    cost[1] = float("nan")  # nothing finite at all
    cost[2, 0, :] = float("inf")  # a query nobody can take
    # Per problem, our sentinel is rfdetr's sentinel for that problem's (valid) matrix.
    for k in range(4):
        ours = sanitize_cost(cost[k : k + 1, :, valid[k]], valid[k : k + 1, valid[k]])[0]
        torch.testing.assert_close(ours, HungarianMatcher._sanitize_cost_matrix(cost[k][:, valid[k]]))
    converged, check = solve_and_check(cost, valid)
    assert converged.all()
    assert_exact(check)


def test_single_query_square_and_too_many_targets() -> None:
    generator = torch.Generator().manual_seed(4)
    one = torch.rand(16, 1, 3, generator=generator)
    valid = torch.zeros(16, 3, dtype=torch.bool)
    valid[:, 1] = True
    converged, check = solve_and_check(one, valid)
    assert converged.all() and (check.rel_err == 0).all()
    square, valid = detr_costs(64, 30, 30, generator, min_targets=30)
    converged, check = solve_and_check(square, valid)
    assert converged.all()
    assert_exact(check)
    # More valid targets than queries: the first Q are matched (injectively), the problem is flagged.
    cost = torch.rand(2, 4, 6, generator=generator)
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    query_of_target, converged = solve_assignment(cost, valid)
    assert converged.tolist() == [False, True]
    assert sorted(query_of_target[0, :4].tolist()) == [0, 1, 2, 3]


def test_round_budget_falls_back_to_a_valid_greedy_assignment() -> None:
    generator = torch.Generator().manual_seed(5)
    cost, valid = detr_costs(200, 30, 30, generator, mode="untrained", min_targets=20)
    full = solve_assignment_with_stats(cost, valid)
    assert full.converged.all() and int(full.iterations) > 8
    result = solve_assignment_with_stats(cost, valid, max_rounds=8, auction_rounds=0)
    assert not result.converged.all()
    check = compare_with_scipy(cost, valid, result.query_of_target)
    assert check.injective.all()
    assert (check.rel_err[result.converged.numpy()] <= 1e-5).all()


def test_no_gradient_flows() -> None:
    """The solve is outside autograd: with a cost that requires grad, nothing is saved for a backward through the
    solver's loop (it would be built and kept alive every step), and a loss gathered at the assignment gets its
    gradient only on the chosen entries, as with upstream's SciPy indices."""
    cost = torch.rand(4, 10, 5, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        query_of_target, converged = solve_assignment(cost, torch.ones(4, 5, dtype=torch.bool))
    assert converged.all() and not saved, f"{len(saved)} tensors saved for backward inside the solver"
    cost.gather(1, query_of_target[:, None, :]).sum().backward()
    chosen = torch.zeros_like(cost).scatter_(1, query_of_target[:, None, :], 1.0)
    assert torch.equal(cost.grad, chosen) and int(chosen.sum()) == 4 * 5  # one distinct query per target


@pytest.mark.slow
def test_xla_graph_matches_scipy_and_eager() -> None:
    import torch_xla

    device = torch_xla.device()
    solve = compiled_solver()
    generator = torch.Generator().manual_seed(6)
    for per_mode, num_queries, max_targets in ((64, 300, 60), (64, 30, 30)):
        cost, valid = mixed_batch(generator, per_mode, num_queries, max_targets)
        query_of_target, converged = solve(cost.to(device), valid.to(device))
        query_of_target, converged = query_of_target.cpu(), converged.cpu()
        assert converged.all()
        check = compare_with_scipy(cost, valid, query_of_target)
        assert_exact(check, strict_fraction=1.0)
        eager, _ = solve_assignment(cost, valid)
        assert (compare_with_scipy(cost, valid, eager).rel_err == check.rel_err).all()


@pytest.mark.slow
def test_xla_compiles_once_and_never_reads_back() -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def counter(name: str) -> int:
        return met.counter_value(name) or 0

    def samples(name: str) -> int:
        data = met.metric_data(name)
        return data[0] if data else 0

    def fallbacks() -> dict[str, int]:
        return {name: counter(name) for name in met.counter_names() if name.startswith("aten::")}

    device = torch_xla.device()
    solve = compiled_solver()
    generator = torch.Generator().manual_seed(7)
    batches = [detr_costs(16, 20, 12, generator, mode=mode) for mode in ("random", "trained", "untrained", "random")]
    on_device = [(cost.to(device), valid.to(device)) for cost, valid in batches]
    torch_xla.sync()
    compiles, executions, reads, before = (
        counter("UncachedCompile"), samples("ExecuteReplicatedTime"), samples("TransferFromDeviceTime"), fallbacks()
    )
    results = [solve(cost, valid) for cost, valid in on_device]
    xm.wait_device_ops()  # executions are asynchronous; their metrics land when they finish
    assert counter("UncachedCompile") - compiles == 1  # one graph, compiled on the first call only
    assert samples("ExecuteReplicatedTime") - executions == len(batches)  # one execution per call
    assert samples("TransferFromDeviceTime") == reads  # nothing came back to the host
    assert fallbacks() == before  # no op fell back to the CPU
    for (cost, valid), (query_of_target, converged) in zip(batches, results):
        assert converged.cpu().all()
        assert_exact(compare_with_scipy(cost, valid, query_of_target.cpu()), strict_fraction=1.0)


@pytest.mark.slow
def test_xla_batch_sharded_over_the_mesh() -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    num_devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(num_devices), (num_devices,), ("data",))
    cost, valid = detr_costs(16 * num_devices, 30, 30, torch.Generator().manual_seed(8))
    cost_xla, valid_xla = cost.to(torch_xla.device()), valid.to(torch_xla.device())
    xs.mark_sharding(cost_xla, mesh, ("data", None, None))
    xs.mark_sharding(valid_xla, mesh, ("data", None))
    query_of_target, converged = compiled_solver()(cost_xla, valid_xla)
    assert torch_xla._XLAC._get_xla_sharding_spec(query_of_target).startswith(f"{{devices=[{num_devices},1]")
    assert converged.cpu().all()
    assert_exact(compare_with_scipy(cost, valid, query_of_target.cpu()), strict_fraction=1.0)
