"""Two ``aot`` reports of the same recipe, component by component: a markdown table and a PNG of bytes per step.

    python benchmarks/compare_components.py BEFORE.json AFTER.json --png OUT.png [--program train_step] [--hbm]

``--hbm``: the HBM part of each component's bytes and ``hbm_bytes_accessed`` (the cost analysis counts on-chip
memory too: ``spmd_rfdetr/aot/components.py``) instead of all of them. Reports of ``aot --hbm_only`` (compiled with
no on-chip memory) are all HBM already, and say so in the labels.

Each report must carry ``bytes_by_component`` (``aot`` writes it; ``benchmarks/components.py`` adds it to an older
report from its kept compile).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def components(report: Path, program: str, key: str = "bytes") -> tuple[dict, dict[str, float], bool]:
    """(the program's entry, its bytes per step by component; ``key`` ``hbm_bytes``: their HBM part; whether the
    report was compiled with no on-chip memory, ``aot --hbm_only``)."""
    loaded = json.loads(report.read_text())
    entry = next(p for p in loaded["programs"] if p["name"].startswith(program))
    return entry, {c["component"]: c[key] for c in entry["bytes_by_component"]["components"]}, "hbm_only" in loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--program", default="train_step", help="program name prefix (train_step, eval)")
    parser.add_argument("--png", type=Path)
    parser.add_argument("--min-gb", type=float, default=1.0, help="components under this in both go to 'the rest'")
    parser.add_argument("--hbm", action="store_true", help="the HBM part of the bytes (reports with hbm_bytes)")
    args = parser.parse_args()
    key, total = ("hbm_bytes", "hbm_bytes_accessed") if args.hbm else ("bytes", "bytes_accessed")
    (old_entry, old, old_hbm_only), (new_entry, new, new_hbm_only) = (components(args.before, args.program, key),
                                                                      components(args.after, args.program, key))
    hbm_only = old_hbm_only and new_hbm_only
    images = new_entry["images_per_device"]
    names = sorted(set(old) | set(new), key=lambda n: -max(old.get(n, 0.0), new.get(n, 0.0)))
    shown = [n for n in names if max(old.get(n, 0.0), new.get(n, 0.0)) >= args.min_gb * 1e9]
    rows = [(n, old.get(n, 0.0), new.get(n, 0.0)) for n in shown]
    rest = [n for n in names if n not in shown]
    rows.append(("the rest", sum(old.get(n, 0.0) for n in rest), sum(new.get(n, 0.0) for n in rest)))
    print("| component | before: GB / step / chip | after | after / before |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a / 1e9:.2f} | {b / 1e9:.2f} | {b / a if a else float('nan'):.2f} |")
    a, b = old_entry[total], new_entry[total]
    what = ("HBM part of the compiler's bytes accessed" if args.hbm else
            "compiler's bytes accessed, no on-chip memory (all HBM)" if hbm_only else "compiler's bytes accessed")
    print(f"| **{what}** | **{a / 1e9:.1f}** ({a / images:.3g} / image) | **{b / 1e9:.1f}** "
          f"({b / images:.3g} / image) | {b / a:.2f} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [r[1] / 1e9 for r in rows], height=0.4, label=f"before ({a / 1e9:.0f} GB)")
        ax.barh([y - 0.2 for y in ys], [r[2] / 1e9 for r in rows], height=0.4, label=f"after ({b / 1e9:.0f} GB)")
        ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("HBM part of the bytes accessed per step per chip, GB" if args.hbm else
                      "HBM bytes accessed per step per chip, GB (libtpu, compiled with no on-chip memory)"
                      if hbm_only else
                      "bytes accessed per step per chip, GB (libtpu's cost analysis: HBM and on-chip memory)")
        ax.set_title(f"{new_entry['name']} on {new_entry['topology']}, {images} images per chip")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
