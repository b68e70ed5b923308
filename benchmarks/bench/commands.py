"""The parent side of each benchmark: start the children, combine their results, print the table, write JSON + PNG."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

from . import RESULTS
from .children import default_devices, on_cpu_host, run_child
from .report import comparison_table, default_stem, hardware_tag, mfu, plot_scaling, plot_steps, write_json

#: Keys of a side compared ours/upstream in the JSON's ``ratios``.
RATIO_KEYS = ("step_time_median_s", "loop_step_time_s", "host_time_median_s", "not_executing_per_step_s",
              "images_per_sec", "images_per_sec_per_chip", "graphs_per_step", "transfers_per_step", "compiles",
              "compile_time_s")


def _ratios(ours: dict[str, Any], upstream: dict[str, Any]) -> dict[str, float | None]:
    return {k: (ours[k] / upstream[k] if upstream.get(k) and ours.get(k) is not None else None) for k in RATIO_KEYS}


def main_compare(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Ours once per ``--step-mode`` (each its own child, back to back, same batches and seed), then upstream."""
    devices = default_devices(args)
    modes: list[str] = args.step_mode
    spec = {"run_config": dataclasses.asdict(cfg), "warmup": args.warmup, "steps": args.steps, "num_batches": 2,
            "count_flops": not args.no_flops, "expect_devices": args.devices if not on_cpu_host() else None}
    by_mode: dict[str, dict[str, Any]] = {}
    for i, mode in enumerate(modes):
        mode_spec = dict(spec, step_mode=mode, count_flops=spec["count_flops"] and i == 0)
        by_mode[mode] = run_child("ours", mode_spec, devices, args.child_timeout, label=f"ours ({mode})")
    ours = by_mode[modes[0]]
    for side in by_mode.values():  # the same model: counted once
        side["flops_per_image"] = ours.get("flops_per_image")
    upstream = None
    if args.compare == "upstream":
        up_cfg = copy.deepcopy(cfg)
        up_cfg.data.global_batch_size, up_cfg.data.per_device_batch_size = ours["global_batch"], None
        up_spec = dict(spec, run_config=dataclasses.asdict(up_cfg), count_flops=False, expect_devices=None)
        upstream = run_child("upstream", up_spec, 1, args.child_timeout)
        upstream["flops_per_image"] = ours.get("flops_per_image")
    for side in (*by_mode.values(), upstream):
        if side is not None:
            side["mfu"] = mfu(side)
    payload: dict[str, Any] = {
        "benchmark": "train_step",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config_file": args.config,
        "config": ours["resolved_run_config"],
        "model_config": ours["resolved_model_config"],
        "bench": {"warmup": args.warmup, "steps": args.steps, "seed": args.seed, "data": "synthetic, fixed",
                  "synthetic_batches": spec["num_batches"], "lr_schedule": "constant",
                  "fast_compile": args.fast_compile, "step_modes": modes},
        "environment": {**ours["environment"], "device": ours["device"],
                        "upstream_device": upstream["device"] if upstream else None},
        "ours": ours,  # the first --step-mode
        "ours_by_mode": by_mode,
        "upstream": upstream,
    }
    if upstream:
        payload["ratio_step_time"] = ours["step_time_median_s"] / upstream["step_time_median_s"]
        payload["ratios"] = _ratios(ours, upstream)
        payload["ratios_by_mode"] = {mode: _ratios(side, upstream) for mode, side in by_mode.items()}
    stem = default_stem(cfg, ours)
    json_path = args.json or RESULTS / f"{stem}.json"
    plot_path = args.plot or json_path.with_suffix(".png")
    payload["plot"] = str(plot_path)
    write_json(json_path, payload)
    title = (f"RF-DETR {cfg.model.variant} {ours['resolved_model_config']['resolution']}px, global batch "
             f"{ours['global_batch']}, {cfg.trainer.precision}, {hardware_tag(ours)} ({datetime.date.today()})")
    sides = {(f"ours ({mode})" if len(modes) > 1 else "ours"): side for mode, side in by_mode.items()}
    if upstream:
        sides["upstream"] = upstream
    plot_steps(plot_path, sides, title)
    print(f"## {title}\n")
    print(comparison_table(by_mode, upstream))
    for name, side in sides.items():
        if side["compiles_in_timed_steps"]:
            print(f"\nnote: {name} compiled {side['compiles_in_timed_steps']} graph(s) during the timed steps "
                  "(they are in its step-time statistics); use a longer --warmup (the graph changes once after step 1)")
        if side.get("step_mode_fallback_reason"):
            print(f"\nnote: {name} fell back to {side['step_mode_used']}: {side['step_mode_fallback_reason']}")
    if upstream:
        for mode, side in by_mode.items():
            r = payload["ratios_by_mode"][mode]
            print(f"\nratio step time ours {mode}/upstream: {r['step_time_median_s']:.3g} (per-step median), "
                  f"{r['loop_step_time_s']:.3g} (back-to-back loop)")
    width = max(len(f"ours {m}") for m in [*by_mode, "upstream"])
    print()
    for mode, side in by_mode.items():
        print(f"losses {f'ours {mode}':<{width}} {[round(x, 4) for x in side['losses']]}")
    if upstream:
        print(f"losses {'upstream':<{width}} {[round(x, 4) for x in upstream['losses']]}")
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    return payload


def main_scaling(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.scaling.split(",") if s.strip()]
    points = []
    for i, n in enumerate(sizes):
        run_cfg = copy.deepcopy(cfg)
        if args.scaling_batch == "weak":
            run_cfg.data.global_batch_size, run_cfg.data.per_device_batch_size = args.per_device_batch * n, None
        spec = {"run_config": dataclasses.asdict(run_cfg), "warmup": args.warmup, "steps": args.steps,
                "num_batches": 2, "count_flops": False, "expect_devices": n, "step_mode": args.step_mode[0]}
        side = run_child("ours", spec, n if on_cpu_host() else None, args.child_timeout,
                         label=f"ours ({args.step_mode[0]}, {n} devices)")
        points.append({"devices": n, "global_batch": side["global_batch"],
                       "per_device_batch_shape": side["per_device_batch_shape"],
                       **{k: side[k] for k in ("step_time_median_s", "step_time_min_s", "step_time_max_s",
                                               "host_time_median_s", "images_per_sec", "images_per_sec_per_chip",
                                               "graphs_per_step", "transfers_per_step", "compiles",
                                               "compile_time_s", "loop_step_time_s",
                                               "not_executing_per_step_s", "step_mode", "step_mode_used")},
                       "run": side})
    base = points[0]
    for p in points:
        if args.scaling_batch == "weak":  # ideal: constant step time
            p["scaling_efficiency"] = base["step_time_median_s"] / p["step_time_median_s"]
        else:  # ideal: step time / (n / n0)
            p["scaling_efficiency"] = base["step_time_median_s"] * base["devices"] / (p["step_time_median_s"] * p["devices"])
    payload = {"benchmark": "scaling", "mode": args.scaling_batch, "command": " ".join(sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "config_file": args.config,
               "config": dataclasses.asdict(cfg), "environment": points[0]["run"]["environment"], "points": points}
    stem = default_stem(cfg, points[-1]["run"], f"-scaling-{args.scaling_batch}")
    json_path = args.json or RESULTS / f"{stem}.json"
    plot_path = args.plot or json_path.with_suffix(".png")
    write_json(json_path, payload)
    title = (f"ours ({args.step_mode[0]} step), {args.scaling_batch} scaling, RF-DETR {cfg.model.variant} "
             f"({datetime.date.today()})")
    plot_scaling(plot_path, points, title)
    print(f"## {title}\n")
    print("| devices | global batch | per-device batch | step median, s | host, s | images/s | images/s/chip | "
          "graphs/step | transfers/step | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p['devices']} | {p['global_batch']} | {p['per_device_batch_shape']} | {p['step_time_median_s']:.3g} | "
              f"{p['host_time_median_s']:.3g} | {p['images_per_sec']:.3g} | {p['images_per_sec_per_chip']:.3g} | "
              f"{p['graphs_per_step']:.3g} | {p['transfers_per_step']:.3g} | {p['scaling_efficiency']:.2f} |")
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    return payload


def main_matcher(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from spmd_rfdetr.model.upstream import upstream_configs

    cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, cfg.model.num_classes)
    groups, layers = cfgs.model.group_detr, cfgs.model.dec_layers + (1 if cfgs.model.two_stage else 0)
    spec = {"images": args.matcher_images, "group_detr": groups, "num_classes": cfg.model.num_classes,
            "queries": [int(x) for x in args.matcher_queries.split(",")],
            "targets": [int(x) for x in args.matcher_targets.split(",")], "reps": args.steps, "seed": args.seed}
    result = run_child("matcher", spec, 1, args.child_timeout)
    payload = {"benchmark": "matcher", "command": " ".join(sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "spec": spec,
               "matcher_calls_per_step": layers, "environment": result["environment"], "device": result["device"],
               "rows": result["rows"]}
    tag = f"{cfg.model.variant}-matcher-i{args.matcher_images}-g{groups}-{hardware_tag(result)}-{datetime.date.today()}"
    json_path = args.json or RESULTS / f"{tag}.json"
    write_json(json_path, payload)
    print(f"## assignment per matcher call: P = {args.matcher_images} images x {groups} groups problems of [Q, T] "
          f"(Q = queries per group, all T targets valid); one step calls the matcher {layers}x "
          f"({cfgs.model.dec_layers} decoder layers + encoder output); {hardware_tag(result)}, one device\n")
    print("| Q | T | P | device solve, ms | loop iterations | compile+first, s | SciPy path, ms (d2h + solve + h2d) | "
          "device/SciPy | optimal | per step: device / SciPy, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"| {r['queries']} | {r['targets']} | | skipped: {r['skipped']} | | | | | | |")
            continue
        print(f"| {r['queries']} | {r['targets']} | {r['problems']} | {r['device_median_s'] * 1e3:.2f} | "
              f"{r['device_loop_iterations']} | {r['device_compile_and_first_s']:.1f} | {r['scipy_median_s'] * 1e3:.2f} "
              f"({r['scipy_d2h_median_s'] * 1e3:.2f} + {r['scipy_solve_median_s'] * 1e3:.2f} + "
              f"{r['scipy_h2d_median_s'] * 1e3:.2f}) | {r['ratio_device_over_scipy']:.3g} | {r['optimal']} | "
              f"{layers * r['device_median_s'] * 1e3:.1f} / {layers * r['scipy_median_s'] * 1e3:.1f} |")
    print(f"\nJSON: {json_path}")
    return payload


