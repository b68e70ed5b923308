"""Time the on-device assignment solver against SciPy on the host (including the transfers) on the XLA device.

Default problem count: an RF-DETR Nano training step at global batch 8 matches
``8 images x (2 decoder layers + 1 encoder output) x 13 query groups = 312`` problems of 300 queries each
(rfdetr's matcher solves every group of ``num_queries`` queries separately).

    python benchmarks/bench_matcher.py                        # SPMD, 4 CPU devices, batch sharded over the mesh
    python benchmarks/bench_matcher.py --devices 1 --problems 100 --queries 300 --targets 100
    python benchmarks/bench_matcher.py --no-spmd --json out.json

Per-call times are medians after one warm-up call, as wall time and as this process's CPU time (all threads; less
sensitive to other processes on a shared machine). "device" is one compiled graph (solve + sync, no read-back);
"host" is the upstream way: read the cost matrices back, ``linear_sum_assignment`` per problem, send indices back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=8 * 3 * 13, help="P (default: RF-DETR Nano, batch 8)")
    parser.add_argument("--queries", type=int, nargs="+", default=[30, 300])
    parser.add_argument("--targets", type=int, nargs="+", default=[1, 10, 30, 50, 100])
    parser.add_argument("--mode", default="random", choices=["random", "trained", "untrained"])
    parser.add_argument("--devices", type=int, default=4, help="virtual XLA CPU devices (CPU_NUM_DEVICES)")
    parser.add_argument("--no-spmd", action="store_true", help="plain single-device XLA instead of an SPMD mesh")
    parser.add_argument("--auction-rounds", type=int, default=None, help="warm-start auction rounds (solver default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["CPU_NUM_DEVICES"] = str(1 if args.no_spmd else args.devices)
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from scipy.optimize import linear_sum_assignment

    if not args.no_spmd:
        xr.use_spmd()
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr.model.matching import solve_assignment_with_stats
    from spmd_rfdetr.model.matching_problems import detr_costs

    torch.set_num_threads(1)
    device = torch_xla.device()
    mesh = None
    if not args.no_spmd and args.problems % args.devices == 0:
        mesh = xs.Mesh(np.arange(args.devices), (args.devices,), ("data",))

    def solve(cost: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kwargs = {} if args.auction_rounds is None else {"auction_rounds": args.auction_rounds}
        result = solve_assignment_with_stats(cost, valid, **kwargs)
        return result.query_of_target, result.converged, result.iterations

    def refresh(cost: torch.Tensor) -> torch.Tensor:
        return cost * 1.0  # a fresh device-side tensor, so reading it back is a real transfer

    solve_compiled = torch_xla.compile(solve, full_graph=True)
    refresh_compiled = torch_xla.compile(refresh, full_graph=True)
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"P={args.problems} mode={args.mode} {'1 device' if args.no_spmd else f'SPMD {args.devices} devices'}"
          f"{', batch sharded' if mesh else ''}")
    print(f"{'Q':>4s} {'T':>4s} {'compile s':>9s} {'device ms':>9s} {'host ms':>8s} {'device cpu-ms':>13s} "
          f"{'host cpu-ms':>11s} {'iters':>6s}")
    for num_queries in args.queries:
        for num_targets in args.targets:
            if num_targets > num_queries:
                continue
            cost, valid = detr_costs(
                args.problems, num_queries, num_targets, generator, mode=args.mode, min_targets=num_targets
            )
            cost_dev, valid_dev = cost.to(device), valid.to(device)
            if mesh is not None:
                xs.mark_sharding(cost_dev, mesh, ("data", None, None))
                xs.mark_sharding(valid_dev, mesh, ("data", None))
            torch_xla.sync()
            xm.wait_device_ops()

            compile_before = (met.metric_data("CompileTime") or (0, 0))[1]
            start = time.perf_counter()
            query_of_target, converged, iterations = solve_compiled(cost_dev, valid_dev)
            xm.wait_device_ops()
            first_call = time.perf_counter() - start
            compile_seconds = ((met.metric_data("CompileTime") or (0, 0))[1] - compile_before) / 1e9
            assert bool(converged.cpu().all())
            iterations = int(iterations.cpu())

            device_times, device_cpu = [], []
            for _ in range(args.repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                solve_compiled(cost_dev, valid_dev)
                xm.wait_device_ops()
                device_times.append(time.perf_counter() - start)
                device_cpu.append(time.process_time() - start_cpu)

            host_times, host_cpu = [], []
            for _ in range(args.repeats + 1):
                fresh = refresh_compiled(cost_dev)
                xm.wait_device_ops()
                start, start_cpu = time.perf_counter(), time.process_time()
                host_cost, host_valid = fresh.cpu().numpy(), valid_dev.cpu().numpy()
                chosen = np.zeros(host_valid.shape, dtype=np.int64)
                for k in range(len(host_cost)):
                    targets = np.flatnonzero(host_valid[k])
                    rows_k, cols_k = linear_sum_assignment(host_cost[k][:, targets])
                    chosen[k, targets[cols_k]] = rows_k
                torch.as_tensor(chosen).to(device)
                torch_xla.sync()
                xm.wait_device_ops()
                host_times.append(time.perf_counter() - start)
                host_cpu.append(time.process_time() - start_cpu)
            row = {
                "problems": args.problems,
                "queries": num_queries,
                "targets": num_targets,
                "compile_seconds": compile_seconds,
                "first_call_seconds": first_call,
                "device_ms": 1e3 * statistics.median(device_times),
                "host_scipy_ms": 1e3 * statistics.median(host_times[1:]),
                "device_cpu_ms": 1e3 * statistics.median(device_cpu),
                "host_scipy_cpu_ms": 1e3 * statistics.median(host_cpu[1:]),
                "iterations": iterations,
            }
            rows.append(row)
            print(f"{num_queries:4d} {num_targets:4d} {compile_seconds:9.2f} {row['device_ms']:9.1f} "
                  f"{row['host_scipy_ms']:8.1f} {row['device_cpu_ms']:13.1f} {row['host_scipy_cpu_ms']:11.1f} "
                  f"{iterations:6d}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
