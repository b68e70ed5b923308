"""Reporting in the parent: markdown tables, plots, output file names and JSON."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any


def fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}"
    return f"{value}{unit}"


def mfu(side: dict[str, Any]) -> float | None:
    peak, flops = side["device"].get("peak_bf16_tflops_per_chip"), side.get("flops_per_image")
    if not peak or not flops:
        return None
    return flops * side["images_per_sec"] / (peak * 1e12 * side["device"]["chips"])


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return ""
    return f"{a / b:.3g}x"


def _mem(s: dict[str, Any]) -> float | None:
    return None if s.get("peak_memory_bytes") is None else s["peak_memory_bytes"] / 2**30


def _gflops(s: dict[str, Any]) -> float | None:
    return None if not s.get("flops_per_image") else s["flops_per_image"] / 1e9


def _mfu_text(s: dict[str, Any]) -> str | None:
    value = mfu(s)
    return None if value is None else f"{100 * value:.2f}%"


def _step_mode(s: dict[str, Any]) -> str | None:
    used = s.get("step_mode_used")
    if used is None:
        return None
    return used if used == s.get("step_mode") else f"{used} (asked {s.get('step_mode')}: fell back)"


#: (row name, value of a side); None shows as n/a.
TABLE_ROWS = [
    ("step mode used", _step_mode),
    ("compilations (all steps)", lambda s: s["compiles"]),
    ("compile time, s", lambda s: s["compile_time_s"]),
    ("compilations after warm-up", lambda s: s["compiles_in_timed_steps"]),
    ("graph executions / step", lambda s: s["graphs_per_step"]),
    ("device->host transfers / step", lambda s: s["transfers_per_step"]),
    ("aten:: CPU fallbacks / step", lambda s: s["aten_fallbacks_per_step"]),
    ("Python runs of the step (all calls)", lambda s: s.get("python_traces")),
    ("step calls", lambda s: s.get("step_calls")),
    ("step time median, s", lambda s: s["step_time_median_s"]),
    ("step time min, s", lambda s: s["step_time_min_s"]),
    ("step time max, s", lambda s: s["step_time_max_s"]),
    ("step time in a loop (no per-step wait), s", lambda s: s.get("loop_step_time_s")),
    ("host time / step (median), s", lambda s: s["host_time_median_s"]),
    ("XLA execute time / step, s", lambda s: s["execute_time_per_step_s"]),
    ("not executing a graph / step, s", lambda s: s.get("not_executing_per_step_s")),
    ("XLA execute time / step in the loop, s", lambda s: s.get("loop_execute_time_per_step_s")),
    ("outside graph execution / step (loop), s", lambda s: s.get("outside_execution_per_step_s")),
    ("images/s", lambda s: s["images_per_sec"]),
    ("images/s/chip", lambda s: s["images_per_sec_per_chip"]),
    ("peak device memory, GiB", _mem),
    ("GFLOP / image (fwd+bwd)", _gflops),
    ("MFU (bf16 peak)", _mfu_text),
]


def comparison_table(ours: dict[str, Any] | dict[str, dict[str, Any]], upstream: dict[str, Any] | None) -> str:
    """One column per step mode of ours (``ours`` is one side, or ``{mode: side}``), then upstream and the ratio
    ours/upstream for each mode."""
    by_mode = {ours.get("step_mode", "ours"): ours} if "side" in ours else dict(ours)
    heads = []
    for mode, side in by_mode.items():
        mesh = "x".join(str(v) for v in side["mesh_shape"].values())
        heads.append(f"ours {mode} ({side['precision']}, SPMD mesh {mesh})")
    if upstream:
        heads.append(f"upstream ({upstream['precision']}, 1 device)")
        heads += [f"ours {mode}/upstream" for mode in by_mode]
    lines = ["| metric | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name, get in TABLE_ROWS:
        values = [get(side) for side in by_mode.values()]
        cells = [fmt(v) for v in values]
        if upstream:
            b = get(upstream)
            cells.append(fmt(b))
            cells += [_ratio(a, b) for a in values]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_steps(path: Path, sides: dict[str, dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(9, 5))
    palette = iter(["tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown"])
    warmup = 0
    for name, side in sides.items():
        color = "tab:orange" if name == "upstream" else next(palette, None)
        per_step = side["per_step"]
        warmup = max(warmup, side["warmup_steps"])
        x = [r["step"] for r in per_step]
        ax.plot(x, [r["step_s"] for r in per_step], "o-", color=color,
                label=f"{name}: wall time per step (median {side['step_time_median_s']:.3g} s)")
        ax.plot(x, [r["host_s"] for r in per_step], ":", color=color, alpha=0.7, label=f"{name}: host time per step")
        compiled = [r for r in per_step if r["compiles"]]
        if compiled:
            ax.scatter([r["step"] for r in compiled], [r["step_s"] for r in compiled], s=140, marker="*",
                       color=color, edgecolor="black", zorder=5,
                       label=f"{name}: steps that compiled ({side['compiles']} graphs, {side['compile_time_s']:.0f} s)")
            for r in compiled:
                ax.annotate(f"{int(r['compiles'])}x, {r['compile_s']:.0f}s", (r["step"], r["step_s"]),
                            textcoords="offset points", xytext=(6, 6), fontsize=8, color=color)
    if warmup:
        ax.axvspan(0.5, warmup + 0.5, color="gray", alpha=0.12, label="warm-up (not in the statistics)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("time per step, s (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(path: Path, points: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = [p["devices"] for p in points]
    ax.plot(n, [p["step_time_median_s"] for p in points], "o-", label="step time (median)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices in the mesh")
    ax.set_ylabel("time per step, s (log scale)")
    ax2 = ax.twinx()
    ax2.plot(n, [p["images_per_sec"] for p in points], "s--", color="tab:green", label="images/s")
    ax2.set_ylabel("images/s")
    ax.set_title(title, fontsize=10)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hardware_tag(side: dict[str, Any]) -> str:
    dev = side["device"]
    if dev["device_type"] == "TPU":
        return f"tpu_{dev['tpu_generation'] or 'unknown'}-{dev['runtime_device_count']}"
    return f"xla_{dev['device_type'].lower()}{dev['runtime_device_count']}"


def default_stem(cfg: Any, side: dict[str, Any], suffix: str = "") -> str:
    prec = "" if cfg.trainer.precision == "fp32" else f"-{cfg.trainer.precision}"
    resolution = side.get("resolved_model_config", {}).get("resolution", cfg.model.resolution)
    return (f"{cfg.model.variant}-{resolution}-b{side['global_batch']}{prec}-{hardware_tag(side)}{suffix}-"
            f"{datetime.date.today().isoformat()}")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


