"""Bytes by component of programs the ``aot`` verb compiled, re-read from its kept work directory (no new compile).

    python -m spmd_rfdetr aot --config configs/v5e.yaml --topology v5e:2x4 --json report.json --keep work/
    python benchmarks/components.py work/ --topology v5e:2x4 --json report.json [--markdown]

Reads ``work/results.json`` and the optimised HLO the compile child kept (``work/compiled/*.hlo.txt``), prices each
gather fusion by compiling it alone for one chip of the topology (seconds, not the program's minutes), and writes
:func:`spmd_rfdetr.aot.components.bytes_by_component` into each program of ``report.json`` (``bytes_by_component``),
as the verb itself does; ``--markdown`` prints the tables for ``benchmarks/README.md``. For a breakdown after a change
to the attribution rules, or of a compile made before the verb reported one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from spmd_rfdetr.aot.components import bytes_by_component, format_table
from spmd_rfdetr.aot.op_costs import gather_fusions
from spmd_rfdetr.aot.tpu_compile import build_topology, fusion_costs, hbm_figures


def markdown(name: str, table: dict, images: int) -> str:
    lines = [f"**{name}** ({images} images per chip; sum {table['total_bytes'] / 1e9:.1f} GB, the compiler's "
             f"{table['compiler_bytes'] / 1e9:.1f} GB: {table['vs_compiler']:+.1%}; HBM "
             f"{table['total_hbm_bytes'] / 1e9:.1f} GB)", "",
             "| component | GB / step / chip | share | bytes / image | HBM GB / step / chip "
             "| matmul GFLOP / step / chip |",
             "|---|---|---|---|---|---|"]
    for r in table["components"]:
        lines.append(f"| {r['component']} | {r['bytes'] / 1e9:.2f} | {r['share']:.1%} | {r['bytes_per_image']:.3g} | "
                     f"{r['hbm_bytes'] / 1e9:.2f} | {r['matmul_flops'] / 1e9:,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="the aot verb's --keep directory")
    ap.add_argument("--topology", required=True, help="the topology it was compiled for (gathers are priced on it)")
    ap.add_argument("--json", type=Path, help="the verb's report to add bytes_by_component to")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    a = ap.parse_args(argv)
    devices, chip, _ = build_topology(a.topology)
    tables = {}
    for r in json.loads((a.work / "results.json").read_text())["results"]:
        if not r.get("compiled"):
            continue
        text = (a.work / "compiled" / (re.sub(r"[^\w.\-]+", "_", r["name"]) + ".hlo.txt")).read_text()
        table = bytes_by_component(text, r["bytes_accessed"], r["flops"], r.get("images_per_device"),
                                   fusion_bytes=fusion_costs(gather_fusions(text), devices))
        tables[r["name"]] = table
        print(markdown(r["name"], table, r["images_per_device"]) if a.markdown else format_table(r["name"], table))
        print()
    if a.json:
        report = json.loads(a.json.read_text())
        for p in report["programs"]:
            if p["name"] in tables:
                p["bytes_by_component"] = tables[p["name"]]
                p.update(hbm_figures(p, chip))
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
