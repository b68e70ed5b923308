"""Upstream's training step on the TPU compiler (``run.py --compare upstream --tpu-compiler TOPOLOGY``).

Upstream rfdetr reaches a TPU through Lightning's XLAStrategy: lazy torch_xla, one process per chip, its SciPy matcher
on the host, so each step runs several graphs (up to the matcher's host read, then the loss, backward and optimizer).
The upstream child (:func:`bench.sides.child_upstream`) runs its step on one XLA CPU device with torch_xla's
``XLA_SAVE_TENSORS_FILE`` (every graph it executes, as HLO, cached or not) and notes where each step's graphs end;
here the graphs of the steady-state steps (after the warm-up) are compiled for one chip of the topology with libtpu
(as the ``aot`` verb compiles ours) and summed per step: FLOPs, HBM bytes and the memory-bound roofline, per image,
next to ours from an ``aot`` report of the same config (``--ours-report``). ``--upstream-graphs DIR`` keeps the
child's graphs, so that a second count (``--hbm-only`` or not) compiles them without running the child again.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from .children import run_child

#: One graph of torch_xla's saved-tensors file (``XLA_SAVE_TENSORS_FMT=hlo``): the Python frames that synced it, its
#: HLO module and its hash.
_GRAPH = re.compile(r"TensorsGraphInfo:\n(.*?)\n\s*\n.*?## BEGIN_GRAPH\n(.*?)\n\s*Graph Hash: (\w+)\s*\n"
                    r"## END_GRAPH", re.S)


def graphs_by_step(path: Path, ends: list[int]) -> list[list[tuple[str, str, str]]]:
    """``(hash, where it synced, HLO text)`` of each graph in torch_xla's saved-tensors file, grouped by the step
    whose end offset (the file's size after that step) follows it."""
    text = path.read_bytes()
    steps: list[list[tuple[str, str, str]]] = [[] for _ in ends]
    start = 0
    for i, end in enumerate(ends):
        for m in _GRAPH.finditer(text[start:end].decode()):
            frames = [line.strip() for line in m.group(1).splitlines() if line.strip()]
            steps[i].append((m.group(3), frames[0] if frames else "", m.group(2).strip()))
        start = end
    return steps


def compile_graphs(step_graphs: list[tuple[str, str, str]], devices: list, chip: Any, cache: dict[str, dict],
                   ) -> dict[str, Any]:
    """libtpu's figures for one step's graphs, each compiled for the first of ``devices`` (by hash, once)."""
    from spmd_rfdetr.aot import tpu_compile

    rows = []
    for digest, where, hlo in step_graphs:
        if digest not in cache:
            cost = tpu_compile._cost(tpu_compile.compile_text(hlo, devices))
            cache[digest] = {"hash": digest, "synced_at": where, "flops": cost["flops"],
                             "bytes": cost["bytes_accessed"], "hlo_lines": hlo.count("\n") + 1}
            print(f"[bench] upstream graph {digest[:12]} (synced at {where}): {cost['bytes_accessed'] / 1e9:.2f} GB, "
                  f"{cost['flops'] / 1e9:.1f} GFLOP", file=sys.stderr, flush=True)
        rows.append(cache[digest])
    flops, nbytes = sum(r["flops"] for r in rows), sum(r["bytes"] for r in rows)
    return {"graphs": len(rows), "flops": flops, "bytes": nbytes,
            "roofline_s": max(flops / chip.peak_bf16_flops, nbytes / chip.hbm_bandwidth), "graph_list": rows}


def upstream_graphs(spec: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """Upstream's child result and its graphs by step: run the child (its graphs saved in a temporary directory, or
    in ``--upstream-graphs`` to keep), or read what an earlier run of the same spec kept there."""
    keep = args.upstream_graphs
    if keep is not None and (keep / "child.json").exists():
        kept = json.loads((keep / "child.json").read_text())
        if kept["spec"] != json.loads(json.dumps(spec, default=str)):
            raise SystemExit(f"--upstream-graphs {keep} holds another configuration's graphs (its child.json's spec "
                             "differs): name an empty directory")
        print(f"upstream's graphs from {keep} (not running its child again)", flush=True)
        return kept["upstream"], graphs_by_step(keep / "graphs.hlo.0", kept["upstream"]["graph_offsets"])
    with tempfile.TemporaryDirectory() as tmp:
        where = keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        saved = where / "graphs.hlo"
        Path(f"{saved}.0").unlink(missing_ok=True)  # torch_xla appends: a failed run's graphs would shift the offsets
        upstream = run_child("upstream", spec, 1, args.child_timeout,
                             env={"XLA_SAVE_TENSORS_FILE": str(saved), "XLA_SAVE_TENSORS_FMT": "hlo"})
        steps = graphs_by_step(Path(f"{saved}.0"), upstream["graph_offsets"])
        if keep is not None:
            (keep / "child.json").write_text(json.dumps({"spec": spec, "upstream": upstream}, default=str))
    return upstream, steps


def main_upstream_compiler(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Upstream's step at ours' per-chip batch on one device, its steady-state graphs compiled for the topology."""
    from spmd_rfdetr.aot import chips

    # what can be refused is refused before upstream's child runs (~45 min for v5e.yaml on 2 cores)
    chip = chips.parse_topology(args.tpu_compiler)[0]
    if args.hbm_only and (problem := chips.hbm_only_problem(chip)):
        raise SystemExit(problem)
    report = json.loads(Path(args.ours_report).read_text()) if args.ours_report else None
    if report is not None and bool(report.get("hbm_only")) != bool(args.hbm_only):
        said = ("with", "without")
        raise SystemExit(f"--ours-report {args.ours_report} was compiled {said[not report.get('hbm_only')]} aot "
                         f"--hbm_only, upstream {said[not args.hbm_only]} --hbm-only: counts of different kinds")
    per_chip = cfg.data.per_device_batch_size or cfg.data.global_batch_size
    up_cfg = copy.deepcopy(cfg)
    up_cfg.data.global_batch_size, up_cfg.data.per_device_batch_size = per_chip, None
    spec = {"run_config": dataclasses.asdict(up_cfg), "warmup": args.warmup, "steps": args.steps, "num_batches": 1,
            "count_flops": False, "expect_devices": None, "record_graph_offsets": True}
    upstream, steps = upstream_graphs(spec, args)
    from spmd_rfdetr.aot import tpu_compile

    if args.hbm_only:  # libtpu reads its flags when it loads, below: nothing kept in on-chip memory, as aot --hbm_only
        os.environ.update(chips.hbm_only_env(args.tpu_compiler))
    devices, chip, _ = tpu_compile.build_topology(args.tpu_compiler)
    cache: dict[str, dict] = {}
    steady = [compile_graphs(graphs, devices, chip, cache) for graphs in steps[args.warmup:]]
    step = steady[-1]
    out: dict[str, Any] = {
        "benchmark": "train_step_tpu_compiler",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config_file": str(args.config), "topology": args.tpu_compiler, "images_per_chip": per_chip,
        "hbm_only": chips.hbm_only_label(chip) if args.hbm_only else False,
        "upstream": {"precision": upstream["precision"], "graphs_per_step": [s["graphs"] for s in steady],
                     "bytes_per_step": [s["bytes"] for s in steady], "flops_per_step": [s["flops"] for s in steady],
                     "bytes_per_image": step["bytes"] / per_chip, "flops_per_image": step["flops"] / per_chip,
                     "roofline_ms_per_image": 1e3 * step["roofline_s"] / per_chip, "graphs": step["graph_list"],
                     "losses": upstream["losses"]},
    }
    if report is not None:
        train = next(p for p in report["programs"] if p["name"].startswith("train"))
        ours_images = train["images_per_device"]
        out["ours"] = {"report": str(args.ours_report), "topology": train["topology"],
                       "bytes_per_image": train["bytes_accessed"] / ours_images,
                       "flops_per_image": train["flops"] / ours_images,
                       "roofline_ms_per_image": train["roofline_ms"] / ours_images}
        out["ours_over_upstream"] = {k: out["ours"][k] / out["upstream"][k]
                                     for k in ("bytes_per_image", "flops_per_image", "roofline_ms_per_image")}
    print(table(out))
    path = args.json or Path(tempfile.gettempdir()) / "upstream-tpu-compiler.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"| {out['images_per_chip']} images per chip, {out['topology']} | bytes / image | GFLOP / image | "
             "roofline ms / image |", "|---|---|---|---|"]
    for side in ("ours", "upstream"):
        if side in out:
            s = out[side]
            lines.append(f"| {side} | {s['bytes_per_image']:.3g} | {s['flops_per_image'] / 1e9:.1f} | "
                         f"{s['roofline_ms_per_image']:.2f} |")
    if "ours_over_upstream" in out:
        r = out["ours_over_upstream"]
        lines.append(f"| ours / upstream | {r['bytes_per_image']:.2f} | {r['flops_per_image']:.2f} | "
                     f"{r['roofline_ms_per_image']:.2f} |")
    return "\n".join(lines)
