"""Exactness of ``spmd_rfdetr.model.matching.solve_assignment`` against SciPy, with the numbers behind the tests.

Runs DETR-like and degenerate problem families in eager CPU torch (the same code the XLA graph runs), and prints the
distribution of relative errors of the total cost, the worst cases, and how many loop rounds problems needed.

    python benchmarks/matching_exactness.py            # ~11k problems, about a minute on 2 cores
    python benchmarks/matching_exactness.py --scale 0.2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from spmd_rfdetr.model.matching import solve_assignment_with_stats
from spmd_rfdetr.model.matching_problems import SWEEP, compare_with_scipy, detr_costs


def degenerate_families(generator: torch.Generator, scale: float) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Log-uniform 1e-6..1e4 costs, integer ties, identical targets, NaN/inf sprinkled into DETR costs."""
    n = max(8, int(300 * scale))

    def counts(max_targets: int) -> torch.Tensor:
        return torch.arange(max_targets)[None, :] < torch.randint(0, max_targets + 1, (n, 1), generator=generator)

    span = 10.0 ** (torch.rand(n, 300, 60, generator=generator) * 10.0 - 6.0)
    ties = torch.randint(0, 3, (n, 40, 12), generator=generator).float()
    identical = torch.rand(n, 40, 1, generator=generator).expand(n, 40, 12).contiguous()
    detr, valid = detr_costs(n, 30, 30, generator)
    bad = torch.rand(detr.shape, generator=generator)
    nan_inf = torch.where(bad < 0.05, float("nan"), torch.where(bad > 0.97, float("inf"), detr))
    return [
        ("span 1e-6..1e4 Q=300 T<=60", span, counts(60)),
        ("integer ties Q=40 T<=12", ties, counts(12)),
        ("identical targets Q=40 T<=12", identical, counts(12)),
        ("nan/inf 8% Q=30 T<=30", nan_inf, valid),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the test sweep's problem counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(args.seed)

    families = []
    for num_problems, num_queries, max_targets, mode, min_targets in SWEEP:
        n = max(4, int(num_problems * args.scale))
        cost, valid = detr_costs(n, num_queries, max_targets, generator, mode=mode, min_targets=min_targets)
        families.append((f"detr {mode} Q={num_queries} T={min_targets}..{max_targets}", cost, valid))
    families += degenerate_families(generator, args.scale)

    rows, all_errors, worst = [], [], []
    print(f"{'family':38s} {'P':>5s} {'solve s':>8s} {'iters':>6s} {'rounds p50/p99/max':>19s} {'conv':>6s} "
          f"{'<=1e-5':>7s} {'max rel err':>11s}")
    for name, cost, valid in families:
        start = time.perf_counter()
        result = solve_assignment_with_stats(cost, valid)
        seconds = time.perf_counter() - start
        check = compare_with_scipy(cost, valid, result.query_of_target)
        assert check.injective.all(), name
        rounds = result.rounds.numpy()
        p50, p99 = np.percentile(rounds, [50, 99])
        row = {
            "family": name,
            "problems": len(cost),
            "solve_seconds": seconds,
            "iterations": int(result.iterations),
            "rounds_p50": float(p50),
            "rounds_p99": float(p99),
            "rounds_max": int(rounds.max()),
            "converged": float(result.converged.float().mean()),
            "within_1e-5": float((check.rel_err <= 1e-5).mean()),
            "max_rel_err": float(check.rel_err.max()),
        }
        rows.append(row)
        all_errors.append(check.rel_err)
        for k in np.argsort(check.rel_err)[-3:]:
            if check.rel_err[k] > 0:
                worst.append((float(check.rel_err[k]), name, int(k), int(valid[k].sum())))
        print(f"{name:38s} {len(cost):5d} {seconds:8.2f} {row['iterations']:6d} "
              f"{p50:6.0f}/{p99:5.0f}/{row['rounds_max']:5d} {row['converged']:6.3f} {row['within_1e-5']:7.4f} "
              f"{row['max_rel_err']:11.2e}")

    errors = np.concatenate(all_errors)
    print(f"\n{len(errors)} problems; exactly SciPy's total: {(errors == 0).mean():.5f}; within 1e-5: "
          f"{(errors <= 1e-5).mean():.5f}; within 1e-3: {(errors <= 1e-3).mean():.5f}; max: {errors.max():.3e}")
    nonzero = errors[errors > 0]
    if len(nonzero):
        print("nonzero relative errors, quantiles 50/90/99/100%:", np.quantile(nonzero, [0.5, 0.9, 0.99, 1.0]))
    for rel, name, k, targets in sorted(worst, reverse=True)[:10]:
        print(f"  worst: rel {rel:.3e} in {name}, problem {k} with {targets} targets")
    if args.json:
        summary = {"families": rows, "problems": len(errors), "max_rel_err": float(errors.max()),
                   "within_1e-5": float((errors <= 1e-5).mean()), "exact": float((errors == 0).mean())}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
