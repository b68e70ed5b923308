"""The TPU compiler's verdict on every shipped recipe: ``python -m spmd_rfdetr aot`` per (recipe, topology), one JSON.

    python benchmarks/tpu_compiler.py [--out benchmarks/results/tpu-compiler-DATE.json] [--max-batch]
    python benchmarks/tpu_compiler.py --from v5e.yaml=report.json ...   # tabulate aot --json reports made before

Each run is the ``aot`` verb (libtpu through JAX's compile-only client, the ``aot`` extra: no TPU needed), so the
figures are the compiler's: HBM per chip, FLOPs and bytes accessed per step per chip (XLA's cost analysis of the
partitioned program, a While body counted once), a roofline time from the chip's published peak and bandwidth,
collectives, compile time on this machine. Prints benchmarks/README.md's markdown table. The largest per-chip batch is
the ``--max-batch`` search's (a compile per probe) where it ran, else an estimate from the one compile: temporaries
per image at the shipped batch, scaled to the HBM left with 10% free, marked ``~``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (recipe, topology): every shipped TPU recipe on the slice it is written for (v5e also on one chip).
RUNS = [("v5e.yaml", "v5e:1x1"), ("v5e.yaml", "v5e:2x4"), ("v6e.yaml", "v6e:2x4"), ("v3-8.yaml", "v3:2x2")]
GiB = 2**30


def run(recipe: str, topology: str, out: Path, max_batch: bool, keep: Path | None = None) -> dict:
    name = f"{Path(recipe).stem}-{topology.replace(':', '-')}"
    report = out / f"{name}.json"
    command = [sys.executable, "-m", "spmd_rfdetr", "aot", "--config", str(ROOT / "configs" / recipe),
               "--topology", topology, "--model.num_classes", "90", "--json", str(report)]
    command += (["--max-batch"] if max_batch else []) + (["--keep", str(keep / name)] if keep else [])
    subprocess.run(command, cwd=ROOT, check=False)
    return {"recipe": recipe, **json.loads(report.read_text())}


def largest(report: dict, train: dict, headroom: float = 0.1) -> str:
    found = report.get("max_batch")
    if found:
        return str(found["largest_with_headroom"])
    if not train.get("compiled"):
        return "-"
    memory, per_device = train["memory"], train["images_per_device"]
    fixed = memory["argument"] + memory["output"] - memory["alias"] + memory["generated_code"]
    per_image = memory["temp"] / per_device
    return f"~{int(((1 - headroom) * train['hbm_bytes'] - fixed) // per_image)}"


def table(reports: list[dict]) -> str:
    head = ("| recipe | topology | program | fits | HBM per chip used / capacity | batch per chip | largest with 10% "
            "free | GFLOP / step / chip | GB accessed / step / chip (of it HBM) | roofline ms / step (on HBM bytes) | "
            "collectives (body / loops) | bf16 matmuls | compile s |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for report in reports:
        for p in report["programs"]:
            if not p["compiled"]:
                oom = p.get("oom") or {}
                rows.append(f"| `{report['recipe']}` | {report['topology']} | {p['name']} | **no** | needs "
                            f"{oom.get('needed_bytes', 0) / GiB:.2f} / {oom.get('available_bytes', 0) / GiB:.2f} GiB "
                            f"| {p['images_per_device']} | {largest(report, p)} | | | | | | |")
                continue
            c = p["collectives"]
            matmuls = p.get("matmuls", {})
            share = f"{matmuls.get('bf16', 0)}/{sum(matmuls.values())}" if matmuls else "-"
            hbm = f" ({p['hbm_bytes_accessed'] / 1e9:,.1f})" if "hbm_bytes_accessed" in p else ""
            hbm_ms = f" ({p['roofline_hbm_ms']:.0f})" if "roofline_hbm_ms" in p else ""
            rows.append(
                f"| `{report['recipe']}` | {report['topology']} | {p['name']} | yes | {p['memory']['peak'] / GiB:.2f} / "
                f"{p['hbm_bytes'] / GiB:.2f} GiB ({p['hbm_free_fraction']:.0%} free) | {p['images_per_device']} | "
                f"{largest(report, p) if p['kind'] == 'train' else ''} | {p['flops'] / 1e9:,.0f} | "
                f"{p['bytes_accessed'] / 1e9:,.1f}{hbm} | {p['roofline_ms']:.0f} ({p['bound']}){hbm_ms} | "
                f"{sum(c['body'].values())} / {sum(c['in_loops'].values())} | {share} | {p['compile_s']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="combined JSON (default benchmarks/results/...)")
    parser.add_argument("--max-batch", action="store_true", help="also search the largest batch (slow)")
    parser.add_argument("--from", dest="sources", nargs="*", help="RECIPE=REPORT.json pairs to tabulate instead")
    parser.add_argument("--keep", type=Path, default=None, help="keep each compile's work directory under this one "
                        "(for benchmarks/components.py)")
    args = parser.parse_args()
    today = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"tpu-compiler-{today}.json"
    if args.sources:
        pairs = [source.split("=", 1) for source in args.sources]
        reports = [{"recipe": recipe, **json.loads(Path(path).read_text())} for recipe, path in pairs]
    else:
        work = out.parent / f"tpu-compiler-{today}"
        work.mkdir(parents=True, exist_ok=True)
        reports = [run(recipe, topology, work, args.max_batch, args.keep) for recipe, topology in RUNS]
    out.write_text(json.dumps({"date": today, "reports": reports}, indent=1))
    print(table(reports))


if __name__ == "__main__":
    main()
