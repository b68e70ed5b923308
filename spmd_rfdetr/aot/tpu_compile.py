"""Compile torch_xla's HLO modules ahead of time for a TPU topology with libtpu, on a host without TPUs.

``python -m spmd_rfdetr.aot.tpu_compile DIR --topology v5e:2x2 [--json OUT] [--hlo-out DIR2]`` reads
``DIR/programs.json`` (``{"programs": [{"name", "file", "donors", "num_partitions", ...}]}``; ``file`` a serialized
``HloModuleProto``, or HLO text), compiles each program with libtpu's compile-only client from
``jax.experimental.topologies`` (HLO -> StableHLO -> ``client.compile``), and writes ``DIR/results.json``.

- GSPMD is forced (``use_shardy_partitioner=False``): Shardy ignores torch_xla's GSPMD shardings and silently
  replicates everything. Output shardings may be propagated, as torch_xla compiles them.
- ``hlo_to_stablehlo`` drops torch_xla's buffer donors: ``donors`` are set back as ``jax.buffer_donor`` on ``main``.
  The compiler pairs each donor with an output of its size (``input_output_alias``); ``updated_in_own_buffer`` counts
  the donors (of ``own_outputs``: parameter -> the output that updates the same tensor) written back into their own
  buffer. One written into another tensor's buffer makes the compiler copy around it.
- Figures are per device (a chip; on v3 one of its two cores). ``memory.peak`` = argument + output - alias + temp +
  generated_code: the program's code lives in HBM too. ``hbm_bytes`` is what libtpu offers a program (chips.py;
  ``hbm_published_bytes`` the data-sheet figure); ``hbm_free_fraction`` = 1 - peak / hbm_bytes.
- ``flops``/``bytes_accessed``/``transcendentals`` are XLA's cost analysis of the partitioned program: a While body is
  counted once, whatever its trip count. ``roofline_ms`` = max(flops / peak bf16 FLOP/s, bytes / HBM bandwidth).
  The cost analysis counts accesses to on-chip memory too; ``hbm_bytes_accessed`` is its count times the HBM share
  of the bytes by component (which read each access's memory space from the compiled layouts:
  :mod:`spmd_rfdetr.aot.components`), and ``roofline_hbm_ms`` the roofline on it.
- ``bytes_by_component``: the compiled module's bytes and matmul FLOPs by model component, from op metadata, with
  each While loop's bytes per iteration (:mod:`spmd_rfdetr.aot.components`); printed after the table.
- Exit status: 0 all compiled; 1 any error other than out-of-HBM (wins over 2); 2 any program did not fit in HBM,
  or the topology is not valid.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from spmd_rfdetr.aot import chips as chips_mod
from spmd_rfdetr.aot.components import bytes_by_component, format_table, hbm_share
from spmd_rfdetr.aot.hlo_report import aliased_outputs, parse_oom, report
from spmd_rfdetr.aot.op_costs import gather_fusions

#: libtpu probes for TPU hardware and a metadata server unless told it is elsewhere (no effect on the compile); the
#: JAX runtime stays on the CPU so that a TPU VM's chips are left to torch_xla. A compile needs no chip, so it does not
#: take libtpu's one-process lock (/tmp/libtpu_lockfile) either: two checks, or a check beside a TPU run, can share.
_ENV = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
GiB = 2**30


def versions() -> dict[str, str]:
    """jax, jaxlib and libtpu versions (libtpu's wheel version; its build line comes with the topology)."""
    out = {}
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def build_topology(name: str) -> tuple[list, chips_mod.Chip, str]:
    """(devices sorted by id, chip, canonical name); :class:`chips.TopologyError` when libtpu rejects the name."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    # lazy: jax is the optional aot extra and must load after _ENV is set: it reads JAX_PLATFORMS at import
    from jax.experimental import topologies

    chip, canonical, _ = chips_mod.parse_topology(name)
    try:
        topo = topologies.get_topology_desc(platform="tpu", **chips_mod.topology_kwargs(name))
    except Exception as e:  # XlaRuntimeError INVALID_ARGUMENT: libtpu's own view of the name
        if "INVALID_ARGUMENT" not in str(e) and "NOT_FOUND" not in str(e):
            raise
        reason = str(e).splitlines()[0]
        raise chips_mod.TopologyError(f"invalid TPU topology {name!r} (libtpu: {reason}); "
                                      f"valid names: {chips_mod.valid_names()}") from e
    devices = sorted(topo.devices, key=lambda d: d.id)  # torch_xla's device assignment: global ordinal = id order
    return devices, chip, canonical


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = s = 0
    while i < len(b):
        v, s, i = v | (b[i] & 0x7F) << s, s + 7, i + 1
        if b[i - 1] < 0x80:
            break
    return v, i


def read_hlo(path: Path) -> bytes:
    """A serialized ``HloModuleProto``. HLO text (``HloModule ...``) is converted to one, and an ``HloProto`` (what
    ``--xla_dump_hlo_as_proto`` writes: the module as field 1, nothing else) is unwrapped."""
    data = path.read_bytes()
    if data.lstrip()[:9] == b"HloModule":
        # lazy: jax is the optional aot extra, loaded once build_topology has set _ENV
        from jax._src.lib import _jax

        return _jax.hlo_module_from_text(data.decode()).as_serialized_hlo_module_proto()
    if data[:1] == b"\x0a":  # field 1, length-delimited: HloModuleProto.name, or HloProto.hlo_module if it is all
        n, i = _varint(data, 1)
        if i + n == len(data):
            return data[i:]
    return data


def to_stablehlo(proto: bytes, donors: list[int]) -> bytes:
    """StableHLO bytecode of the module, with ``jax.buffer_donor`` on ``main``'s arguments listed in ``donors``."""
    # lazy: jax is the optional aot extra, loaded once build_topology has set _ENV
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    with jmlir.make_ir_context():
        module = ir.Module.parse(_jax.mlir.hlo_to_stablehlo(proto))
        main = next(op for op in module.body.operations
                    if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        n_args = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
        bad = [d for d in donors if not 0 <= d < n_args]
        if bad:
            raise ValueError(f"donors {bad} are not parameters of the module (it has {n_args})")
        old = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else [ir.DictAttr.get({})] * n_args
        new = []
        for i, d in enumerate(old):
            attrs = {a.name: a.attr for a in ir.DictAttr(d)}
            if i in donors and "tf.aliasing_output" not in attrs:  # an alias already in the HLO header is kept
                attrs["jax.buffer_donor"] = ir.BoolAttr.get(True)
            new.append(ir.DictAttr.get(attrs))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(new)
        return jmlir.module_to_bytecode(module)


def compile_options(devices: list):
    # lazy: jax is the optional aot extra, loaded once build_topology has set _ENV (numpy for its device array)
    import numpy as np
    from jax._src import compiler

    n = len(devices)
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                        device_assignment=np.array(devices, dtype=object).reshape(1, n))
    opts.executable_build_options.use_shardy_partitioner = False
    opts.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]  # as torch_xla compiles
    return opts


def _memory(exe) -> dict[str, Any]:
    m = exe.get_compiled_memory_stats()
    mem = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes,
           "temp": m.temp_size_in_bytes, "generated_code": m.generated_code_size_in_bytes}
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    return mem


def _cost(exe) -> dict[str, float]:
    c = exe.cost_analysis()
    c = (c[0] if c else {}) if isinstance(c, list) else (c or {})
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0)),
            "transcendentals": float(c.get("transcendentals", 0.0))}


def compile_text(text: str, devices: list) -> Any:
    """An HLO module's text (one device's program, no donated arguments) compiled for the first of ``devices``."""
    # lazy: jax is the optional aot extra, loaded once build_topology has set _ENV
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc

    one = devices[:1]
    proto = _jax.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    return one[0].client.compile(to_stablehlo(proto, []), xc.DeviceList(tuple(one)), compile_options(one))


def fusion_costs(modules: dict[str, str], devices: list) -> dict[str, float]:
    """The cost analysis's bytes of each module of :func:`~spmd_rfdetr.aot.op_costs.gather_fusions` compiled alone
    for one device of the topology (identical modules once). One that does not compile is left out."""
    seen, out = {}, {}
    for name, text in modules.items():
        key = text.replace(name, "fused")
        if key not in seen:
            try:
                seen[key] = _cost(compile_text(text, devices))["bytes_accessed"]
            except Exception:  # noqa: BLE001 - a spelling the parser does not take: the model prices it
                seen[key] = None
        if seen[key] is not None:
            out[name] = seen[key]
    return out


def compile_program(prog: dict, base: Path, devices: list, chip: chips_mod.Chip, hlo_out: Path | None) -> dict:
    """Compile one ``programs.json`` entry; the result holds the entry's keys plus what the compiler said."""
    # lazy: jax is the optional aot extra, loaded once build_topology has set _ENV
    from jax._src.lib import xla_client as xc

    res: dict[str, Any] = dict(prog)
    res["compiled"] = False
    n = len(devices)
    try:
        if int(prog.get("num_partitions", n)) != n:
            raise ValueError(f"num_partitions {prog['num_partitions']} != {n} devices of the topology: trace the "
                             f"module on {n} devices or pick a topology with {prog['num_partitions']}")
        bytecode = to_stablehlo(read_hlo(base / prog["file"]), [int(d) for d in prog.get("donors", [])])
        t0 = time.perf_counter()
        try:
            exe = devices[0].client.compile(bytecode, xc.DeviceList(tuple(devices)), compile_options(devices))
        finally:
            res["compile_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:  # the compiler's verdict (XlaRuntimeError) or a bad input: report it, go on
        msg = f"{type(e).__name__}: {e}"
        res["error"] = "\n".join(msg.splitlines()[:8])[:2000]
        if (oom := parse_oom(msg)) is not None:
            res["oom"] = oom
        return res
    res["compiled"] = True
    mem = _memory(exe)
    res["memory"] = mem
    res["hbm_bytes"] = chip.compiler_hbm_bytes
    res["hbm_published_bytes"] = chip.device_hbm_bytes
    res["hbm_free_fraction"] = round(1 - mem["peak"] / chip.compiler_hbm_bytes, 4)
    res.update(_cost(exe))
    t_flops, t_bytes = res["flops"] / chip.device_flops, res["bytes_accessed"] / chip.device_bandwidth
    res["roofline_ms"] = round(max(t_flops, t_bytes) * 1e3, 4)
    res["bound"] = "compute" if t_flops >= t_bytes else "memory"
    text = exe.hlo_modules()[0].to_string()
    if own := prog.get("own_outputs"):  # donated state tensor -> its own update: is it written into its own buffer?
        aliased = aliased_outputs(text)
        res["updated_in_own_buffer"] = sum(aliased.get(int(param)) == output for param, output in own.items())
    try:
        res.update(report(text))
    except ValueError as e:  # an HLO spelling the reader does not know: keep the compiler's numbers
        res["report_error"] = str(e)[:500]
    try:
        res["bytes_by_component"] = bytes_by_component(text, res["bytes_accessed"], res["flops"],
                                                       prog.get("images_per_device"),
                                                       fusion_bytes=fusion_costs(gather_fusions(text), devices))
        res.update(hbm_figures(res, chip))
    except Exception as e:  # noqa: BLE001 - the breakdown is a reading of the text: never lose the compile for it
        res["bytes_by_component_error"] = f"{type(e).__name__}: {e}"[:500]
    if hlo_out is not None:
        hlo_out.mkdir(parents=True, exist_ok=True)
        (hlo_out / (re.sub(r"[^\w.\-]+", "_", prog["name"]) + ".hlo.txt")).write_text(text)
    return res


def hbm_figures(program: dict, chip: chips_mod.Chip) -> dict[str, float]:
    """``hbm_bytes_accessed`` and ``roofline_hbm_ms`` of a compiled program's result that has ``bytes_by_component``."""
    hbm = hbm_share(program["bytes_by_component"]) * program["bytes_accessed"]
    return {"hbm_bytes_accessed": hbm,
            "roofline_hbm_ms": round(max(program["flops"] / chip.device_flops, hbm / chip.device_bandwidth) * 1e3, 4)}


def _row(r: dict) -> list[str]:
    if not r.get("compiled"):
        oom = r.get("oom")
        fit = "OOM" if oom else "ERROR"
        mem = f"{oom['needed_bytes'] / GiB:.2f} / {oom['available_bytes'] / GiB:.2f}" if oom else "-"
        return [r["name"], fit, mem, "-", "-", "-", "-", "-", str(r.get("compile_s", "-"))]
    c = r["collectives"]
    return [r["name"], "yes", f"{r['memory']['peak'] / GiB:.2f} / {r['hbm_bytes'] / GiB:.2f}", f"{r['flops']:.3g}",
            f"{r['bytes_accessed']:.3g}", f"{r['hbm_bytes_accessed']:.3g}" if "hbm_bytes_accessed" in r else "-",
            f"{r['roofline_ms']:.3g} {r['bound'][:3]}",
            f"{sum(c['body'].values())}/{sum(c['in_loops'].values())}", f"{r['compile_s']:.1f}"]


def print_table(results: list[dict], out=sys.stdout) -> None:
    head = ["program", "fits", "peak/HBM GiB", "FLOPs", "bytes", "HBM bytes", "roofline ms", "coll body/loops",
            "compile s"]
    rows = [head] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip(), file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd_rfdetr.aot.tpu_compile", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="work directory holding programs.json and the HLO files")
    ap.add_argument("--topology", required=True, help="e.g. v5e:2x2, v5e:1x1, v6e:2x4, v4:2x2x1, v5p:2x2x1, v3:2x2")
    ap.add_argument("--json", type=Path, default=None, help="results file (default DIR/results.json)")
    ap.add_argument("--hlo-out", type=Path, default=None, help="write each compiled module's HLO text here")
    a = ap.parse_args(argv)
    try:
        programs = json.loads((a.dir / "programs.json").read_text())["programs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"cannot read {a.dir / 'programs.json'}: {e}", file=sys.stderr)
        return 1
    try:
        devices, chip, canonical = build_topology(a.topology)
    except chips_mod.TopologyError as e:
        print(e, file=sys.stderr)
        return 2
    env = {"topology": canonical, "chip": devices[0].device_kind, "chips": len({tuple(d.coords) for d in devices}),
           "devices": len(devices), **versions(),
           "libtpu_build": " ".join(devices[0].client.platform_version.split())}
    out = a.json or a.dir / "results.json"
    results: list[dict] = []
    for prog in programs:
        prog.setdefault("name", str(prog.get("file")))
        print(f"compiling {prog.get('name')!r} for {canonical} ...", file=sys.stderr, flush=True)
        r = compile_program(prog, a.dir, devices, chip, a.hlo_out)
        results.append({**{k: v for k, v in r.items() if k in prog}, **env,
                        **{k: v for k, v in r.items() if k not in prog}})
        out.write_text(json.dumps({"results": results}, indent=1))  # after each program: a long run leaves partials
    print_table(results)
    for r in results:
        if r.get("bytes_by_component"):
            print("\n" + format_table(r["name"], r["bytes_by_component"]))
    failed = [r for r in results if not r["compiled"]]
    for r in failed:
        if r.get("oom"):
            o = r["oom"]
            print(f"{r['name']}: does not fit in HBM: {o['what']} {o['needed_bytes'] / GiB:.2f} GiB > "
                  f"{o['available_bytes'] / GiB:.2f} GiB available per device")
        else:
            print(f"{r['name']}: {r['error']}")
    print(f"results: {out}", file=sys.stderr)
    if any(not r.get("oom") for r in failed):
        return 1
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
