"""The ``aot`` verb: ask the real TPU compiler whether ``fit``'s programs fit a TPU topology, on a machine without one.

Two child processes, so that neither runtime sees the other: :mod:`spmd_rfdetr.aot.trace` (torch_xla, on as many
virtual XLA CPU devices as the topology has TPU devices) writes the HLO of every program ``fit`` runs, then
:mod:`spmd_rfdetr.aot.tpu_compile` (JAX's compile-only client on libtpu, the ``aot`` extra) compiles each for the
topology and reports memory per chip, FLOPs and bytes, a roofline time, collectives in the body and inside loops, the
largest byte movers, the bytes and FLOPs of each model component (:mod:`spmd_rfdetr.aot.components`, from the module
paths the trace writes into the op names) and compile time. ``--max-batch`` searches ``data.per_device_batch_size``
for the largest training step that compiles (and the largest with ``headroom`` of HBM free), compiling the step at
each probe.

Exit status: 0 every program compiles; 2 a config/topology problem or a program that does not fit in HBM (its numbers
printed; found before anything is compiled for the CPU or run); 1 another compiler error.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from spmd_rfdetr.aot.chips import (TopologyError, hbm_only_env, hbm_only_label, hbm_only_problem, parse_topology,
                                    valid_names)
from spmd_rfdetr.aot.trace import config_to_yaml
from spmd_rfdetr.config.options import ConfigError, RunConfig
from spmd_rfdetr.config.backend import TRACED_FOR_ENV, fused_attention_chip_problem
from spmd_rfdetr.config.resolve import resolve_and_check

GiB = 2**30
INSTALL = 'pip install -e ".[aot]"'


class DoesNotFit(RuntimeError):
    """A program does not fit in the chip's HBM (the message has the compiler's numbers): exit status 2."""


def device_count(topology: str) -> int:
    chip, _, dims = parse_topology(topology)
    return math.prod(dims) * chip.devices_per_chip


def aot_check(cfg: RunConfig, topology: str, json_path: str | None = None, max_batch: bool = False,
              headroom: float = 0.1, keep: str | None = None, hbm_only: bool = False) -> dict[str, Any]:
    """Trace and compile ``cfg``'s programs for ``topology``; returns (and writes to ``json_path``) the report.
    ``hbm_only``: compiled with no buffer in on-chip memory (``chips.hbm_only_env``), a measurement of HBM traffic."""
    try:
        chip, canonical, _ = parse_topology(topology)
    except TopologyError as error:
        raise ConfigError(str(error)) from None
    if canonical.split(":")[1] not in chip.topologies:
        raise ConfigError(f"unknown TPU topology {topology!r}; valid names: {valid_names()}")
    if hbm_only and (problem := hbm_only_problem(chip)):
        raise ConfigError(problem)
    if cfg.trainer.fused_attention and (problem := fused_attention_chip_problem(int(chip.name[1]))):
        raise ConfigError(problem)
    devices = device_count(canonical)
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"the aot check needs the TPU compiler (jax + libtpu): {INSTALL}")
    cfg = copy.deepcopy(cfg)
    cfg.mesh.cpu_devices = devices
    previous = os.environ.get(TRACED_FOR_ENV)
    os.environ[TRACED_FOR_ENV] = "TPU"  # the checks judge the config as on the chip (no CPU-only warnings)
    try:
        resolve_and_check(cfg, devices)  # config problems exit 2 before any process starts
    finally:
        if previous is None:
            os.environ.pop(TRACED_FOR_ENV)
        else:
            os.environ[TRACED_FOR_ENV] = previous
    # ~50 MB of HLO a run: removed after, unless kept
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="spmd_rfdetr_aot_") as where:
        work = Path(where)
        work.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {"topology": canonical, "devices": devices,
                                  "programs": _run(cfg, canonical, work, hbm_only=hbm_only)}
        if hbm_only:
            report["hbm_only"] = hbm_only_label(chip)
        if max_batch:
            report["max_batch"] = search_max_batch(cfg, canonical, work, headroom)
    if keep:
        print(f"aot: the HLO, what libtpu compiled and its results.json are in {work}", file=sys.stderr, flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    failed = [r for r in report["programs"] if not r["compiled"]]
    oom = [r for r in failed if r.get("oom")]
    if failed and len(oom) < len(failed):
        raise RuntimeError("the TPU compiler failed: " + "; ".join(r["error"].splitlines()[0] for r in failed))
    if oom:
        raise DoesNotFit(does_not_fit(oom, report.get("max_batch")))
    return report


def _run(cfg: RunConfig, topology: str, work: Path, train_only: bool = False, hbm_only: bool = False,
         ) -> list[dict[str, Any]]:
    """One trace child and one compile child; the compile child's results."""
    trace(cfg, work, train_only)
    return compile_traced(topology, work, hbm_only)


def trace(cfg: RunConfig, work: Path, train_only: bool = False) -> list[dict[str, Any]]:
    """The trace child on ``cfg.mesh.cpu_devices`` virtual devices: ``work/programs.json`` and the HLO files."""
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("*.hlo.pb"):
        stale.unlink()
    (work / "config.yaml").write_text(config_to_yaml(cfg))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(cfg.mesh.cpu_devices), "XLA_HLO_DEBUG": "1",
           TRACED_FOR_ENV: "TPU"}
    command = [sys.executable, "-m", "spmd_rfdetr.aot.trace", str(work / "config.yaml"), str(work)]
    _child(command + (["--train-only"] if train_only else []), env, "tracing the programs")
    return json.loads((work / "programs.json").read_text())["programs"]


class AotFailed(RuntimeError):
    """A trace or compile child crashed (not the compiler's verdict on the config)."""


def compile_traced(topology: str, work: Path, hbm_only: bool = False) -> list[dict[str, Any]]:
    """The compile child (libtpu) on ``work/programs.json``: its results, one per program (``hbm_only``: compiled
    with no buffer in on-chip memory)."""
    results = work / "results.json"
    results.unlink(missing_ok=True)
    command = [sys.executable, "-m", "spmd_rfdetr.aot.tpu_compile", str(work), "--topology", topology,
               "--json", str(results), "--hlo-out", str(work / "compiled")]  # --keep leaves what libtpu compiled
    env = {**os.environ, **(hbm_only_env(topology) if hbm_only else {})}
    _child(command, env, "compiling for the TPU", ok=(0, 1, 2))
    return json.loads(results.read_text())["results"]


def _child(command: list[str], env: dict[str, str], what: str, ok: tuple[int, ...] = (0,)) -> None:
    """Run a child; its output goes to ours. A crash (not a verdict) is an error with the child's last lines."""
    child = subprocess.run(command, env=env, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    noise = ("sharding_propagation", "TF32", "_set_float32_matmul_precision")
    lines = [line for line in child.stderr.splitlines() if not any(n in line for n in noise)]
    if child.returncode not in ok:
        killed = child.returncode == -signal.SIGKILL
        cause = " (SIGKILL: most often this machine ran out of memory; a Nano 384 step at 16 images per chip takes"\
                " ~12 GB of RAM to compile)" if killed else ""
        raise AotFailed(f"{what} failed (exit {child.returncode}){cause}:\n" + "\n".join(lines[-25:]))
    for line in lines:
        if line.startswith(("compiling ", "INFO spmd_rfdetr")):  # not its "results:" path: aot_check says it
            print(line, file=sys.stderr, flush=True)


def _train_result(cfg: RunConfig, topology: str, work: Path, per_device: int) -> dict[str, Any]:
    probe = copy.deepcopy(cfg)
    probe.data.per_device_batch_size = per_device
    resolve_and_check(probe, probe.mesh.cpu_devices)
    print(f"aot: --max-batch probes data.per_device_batch_size={per_device}", file=sys.stderr, flush=True)
    return _run(probe, topology, work, train_only=True)[0]


def search_max_batch(cfg: RunConfig, topology: str, work: Path, headroom: float, limit: int = 4096,
                     ) -> dict[str, Any]:
    """The largest ``data.per_device_batch_size`` whose training step compiles, and the largest with at least
    ``headroom`` of HBM free, by doubling from the config's batch and then bisecting (one compile per probe)."""
    devices = cfg.mesh.cpu_devices
    start = max(1, cfg.data.per_device_batch_size or cfg.data.global_batch_size // devices)
    seen: dict[int, dict[str, Any]] = {}

    def probe(b: int) -> dict[str, Any]:
        if b not in seen:
            seen[b] = _train_result(cfg, topology, work, b)
        return seen[b]

    def largest(fits: Any) -> int:
        low, high, b = 0, None, start  # low: the largest batch known to pass (0: none); high: the smallest failing
        while True:
            if fits(probe(b)):
                low = b
            else:
                high = b
            if high is None:
                if b >= limit:
                    return low
                b *= 2
            elif low == 0:
                if high == 1:
                    return 0
                b = high // 2
            elif high - low <= 1:
                return low
            else:
                b = (low + high) // 2

    compiles = largest(lambda r: r["compiled"])
    roomy = largest(lambda r: r["compiled"] and r["hbm_free_fraction"] >= headroom)
    rows = [{"per_device_batch_size": b, "compiled": r["compiled"],
             "peak_bytes": r["memory"]["peak"] if r["compiled"] else r.get("oom", {}).get("needed_bytes"),
             "hbm_free_fraction": r.get("hbm_free_fraction")} for b, r in sorted(seen.items())]
    return {"largest": compiles, "largest_with_headroom": roomy, "headroom": headroom, "probes": rows}


def does_not_fit(oom: list[dict[str, Any]], search: dict[str, Any] | None) -> str:
    lines = []
    for r in oom:
        o = r["oom"]
        lines.append(f"{r['name']} ({r['images_per_device']} images per device, {r['topology']}) does not fit: "
                     f"{o['what']} {o['needed_bytes'] / GiB:.2f} GiB > {o['available_bytes'] / GiB:.2f} GiB of HBM "
                     "per device (the TPU compiler's numbers)")
    if search is not None:
        lines.append(f"largest data.per_device_batch_size that compiles: {search['largest']} "
                     f"({search['largest_with_headroom']} with {search['headroom']:.0%} of HBM free)")
    else:
        lines.append("lower data.per_device_batch_size (add --max-batch to find the largest that fits), or use "
                     "optim.accumulate / mesh.fsdp")
    return "\n".join(lines)
