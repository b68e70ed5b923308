"""What one instruction of a compiled TPU program costs: its bytes as libtpu's cost analysis counts them, their HBM
part, and its matmul FLOPs (:mod:`spmd_rfdetr.aot.components` charges them to model components).

- Arrays are charged their tile-padded sizes, as the compiled layout pads them (:func:`tiled_bytes`).
- A fusion that holds a gather is charged what the compiler reports for that fusion compiled alone
  (:func:`gather_fusions` names them; the TPU charges about one memory tile per gathered row or value, which the HLO
  text does not show); without that figure, :data:`GATHER_SLICE_BYTES` per slice beyond the tiles it spans.
- Matmul FLOPs from dot and convolution shapes (:func:`matmul_flops`).
- :func:`hbm_bytes`: the part of those bytes that is HBM traffic. The cost analysis counts every memory space: an
  operand the compiler prefetched into on-chip memory (``S(1)``, VMEM) is charged for the copy's read and write and
  again for each read of the copy, and tensors that live in VMEM between two fusions are charged like HBM ones (a
  two-matmul program moving 8.4 MB of HBM is 23.1 MB by its count; ``tests/test_aot.py``). The layouts in
  the compiled text say which side of each access is on chip.
"""

from __future__ import annotations

import re

from spmd_rfdetr.aot.hlo_report import (
    CONTROL_FLOW,
    SKIP_BYTES,
    Computation,
    Instr,
    Module,
    _bits,
    _split_top,
    parse_module,
)

#: Bytes the TPU's cost model charges per gathered slice beyond the memory tiles it spans (libtpu 0.0.21, measured on
#: single-gather programs: an element-wise f32 gather 4,624 bytes per element, rows of 16 bf16 2,604, of 256 4,620).
GATHER_SLICE_BYTES = 512


def _dims(dims: str) -> list[int]:
    out = []
    for d in dims.split(","):
        d = d.strip().lstrip("<=")
        if d.isdigit():
            out.append(int(d))
    return out


_ARRAY_LAYOUT = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*(?:\([^()]*\)[^{}]*)*\})?")


def tiled_bytes(shape: str) -> int:
    """Bytes of an array or tuple shape at its layout's first tile: ``f32[10,20]{1,0:T(8,128)}`` -> 16 x 128 x 4."""
    total = 0.0
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(shape):
        ds = _dims(dims)
        if layout and ds:
            m2m_text, _, rest = layout[1:-1].partition(":")
            m2m = [int(x) for x in m2m_text.split(",") if x.strip().isdigit()]
            tile = re.search(r"T\(([\d,]+)\)", rest)
            if tile and m2m:
                sizes = [int(x) for x in tile.group(1).split(",")]
                for k, t in enumerate(reversed(sizes)):  # the tile's last size is the most minor dimension's
                    if k < len(m2m) and m2m[k] < len(ds):
                        d = m2m[k]
                        ds[d] = -(-ds[d] // t) * t
        n = 1
        for d in ds:
            n *= d
        total += n * _bits(dtype) / 8
    return int(total)


def _tile_bytes(shape: str) -> float:
    m = re.match(r"\s*([a-z][a-z0-9]*)\[", shape)
    if not m:
        return 0.0
    n = 1
    if (tile := re.search(r"T\(([\d,]+)\)", shape)):
        for x in tile.group(1).split(","):
            n *= int(x)
    return n * _bits(m.group(1)) / 8


def _elements(shape: str) -> int:
    m = re.search(r"\[([^\]]*)\]", shape)
    n = 1
    for d in _dims(m.group(1)) if m else []:
        n *= d
    return n


def _operand_shape(comp: Computation, name: str, inline: str) -> str:
    return inline or comp.shapes.get(name, "")


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x.strip().lstrip("-").isdigit()] if m else []


def matmul_flops(ins: Instr, comp: Computation) -> float:
    """2 x output elements x contracted elements of a ``dot``; of a ``convolution`` 2 x output x (kernel / outputs)."""
    if ins.opcode == "dot" and ins.operands:
        lhs = re.search(r"\[([^\]]*)\]", _operand_shape(comp, *ins.operands[0]))
        lhs_dims = _dims(lhs.group(1)) if lhs else []
        k = 1
        for d in _int_list(ins.attrs, "lhs_contracting_dims"):
            k *= lhs_dims[d] if d < len(lhs_dims) else 1
        return 2.0 * _elements(ins.shape) * k
    if ins.opcode == "convolution" and len(ins.operands) > 1:
        return _convolution_flops(ins, comp)
    return 0.0


def _window_pairs(out: int, size: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int,
                  inp: int) -> int:
    """(output position, kernel position) pairs of one spatial dimension that read an input element (not padding,
    not a hole of ``lhs_dilate``): XLA writes a batched matmul as a convolution whose window spans the batch with
    ``lhs_dilate`` = window size, where only one kernel position per output is real."""
    # lazy: the HLO text modules are pure Python (hlo_report, components); only convolution FLOPs need numpy
    import numpy as np

    o = np.arange(out, dtype=np.int64)[:, None]
    k = np.arange(size, dtype=np.int64)[None, :]
    pos = o * stride + k * rhs_dilate - pad_lo
    extent = (inp - 1) * lhs_dilate + 1
    return int(((pos >= 0) & (pos < extent) & (pos % lhs_dilate == 0)).sum())


def _convolution_flops(ins: Instr, comp: Computation) -> float:
    """2 x batch x output features x input features per group x the window pairs that read real input."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    lhs = re.search(r"\[([^\]]*)\]", _operand_shape(comp, *ins.operands[0]))
    rhs = re.search(r"\[([^\]]*)\]", _operand_shape(comp, *ins.operands[1]))
    out = re.search(r"\[([^\]]*)\]", ins.shape)
    if not (labels and lhs and rhs and out):
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs_d, rhs_d, out_d = _dims(lhs.group(1)), _dims(rhs.group(1)), _dims(out.group(1))
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}

    def per_dim(key: str, n: int, default: int) -> list[int]:
        if key not in fields:
            return [default] * n
        return [int(x) for x in fields[key].split("x")]

    spatial = [c for c in rhs_l if c.isdigit()]
    n = len(spatial)
    size, stride = per_dim("size", n, 1), per_dim("stride", n, 1)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", n, 1), per_dim("rhs_dilate", n, 1)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
    pairs = 1
    for j, c in enumerate(spatial):
        pairs *= _window_pairs(out_d[out_l.index(c)], size[j], stride[j], pads[j], lhs_dil[j], rhs_dil[j],
                               lhs_d[lhs_l.index(c)])
    return 2.0 * out_d[out_l.index("b")] * out_d[out_l.index("f")] * rhs_d[rhs_l.index("i")] * pairs


def _slice_tiles(operand: str, slice_sizes: list[int]) -> int:
    """Memory tiles of ``operand``'s layout one gathered slice spans (its two most minor dimensions' tiles)."""
    m = _ARRAY_LAYOUT.search(operand)
    if not m or not m.group(3):
        return 1
    m2m = [int(x) for x in m.group(3)[1:-1].partition(":")[0].split(",") if x.strip().isdigit()]
    tile = re.search(r"T\(([\d,]+)\)", m.group(3))
    sizes = [int(x) for x in tile.group(1).split(",")] if tile else []
    tiles = 1
    for k, t in enumerate(reversed(sizes)):
        if k < len(m2m) and m2m[k] < len(slice_sizes):
            tiles *= -(-max(slice_sizes[m2m[k]], 1) // t)
    return tiles


def _blocks(text: str) -> dict[str, str]:
    """The text of each computation of a module, by name."""
    blocks: dict[str, str] = {}
    name, lines = None, []
    for line in text.splitlines():
        if name is None:
            m = re.match(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$", line)
            if m and not line.startswith("HloModule"):
                name, lines = m.group(2), [line]
        else:
            lines.append(line)
            if line.startswith("}"):
                blocks[name] = "\n".join(lines)
                name = None
    return blocks


#: libtpu's own index custom calls inside gather fusions, which it does not take as input: plain copies instead.
_TPU_CALLS = re.compile(r'custom-call\((%[^()]*)\), custom_call_target="(GatherScatterIndicesBitpacked|'
                        r'AssumeGatherIndicesInBound)"[^\n]*')


def _portable(block: str) -> str:
    block = _TPU_CALLS.sub(r"copy(\1)", block)
    block = re.sub(r"(?<=\])\{[^{}]*\}", "", block)  # layouts (tiles, memory spaces): the compiler picks its own
    block = re.sub(r", metadata=\{[^{}]*\}", "", block)
    return re.sub(r", backend_config=\{.*$", "", block, flags=re.M)


def gather_fusions(text: str) -> dict[str, str]:
    """Each fusion computation that holds a gather, as a module of its own (its parameters the module's): what
    :func:`spmd_rfdetr.aot.tpu_compile.fusion_costs` compiles alone to price it. The TPU prices a gather by the
    memory tiles it reads, one per index for an element-wise gather, which the module's text does not show."""
    mod = parse_module(text)
    blocks = _blocks(text)
    out = {}
    for comp in mod.computations.values():
        for ins in comp.instrs:
            if ins.opcode != "fusion" or not ins.called:
                continue
            name = ins.called[0][1]
            if name in out or not any(i.opcode == "gather" for i in mod.computations[name].instrs):
                continue
            order: list[str] = []
            todo = [name]
            while todo:
                for i in mod.computations[todo.pop()].instrs:
                    for _, callee in i.called:
                        if callee not in order and callee != name:
                            order.append(callee)
                            todo.append(callee)
            body = "\n\n".join(_portable(blocks[c]) for c in reversed(order))
            entry = "ENTRY " + _portable(blocks[name]).lstrip("%")
            out[name] = f"HloModule gather_fusion\n\n{body}\n\n{entry}\n"
    return out


def _model_gather(ins: Instr, comp: Computation) -> float:
    """A gather's bytes without a measurement: per gathered slice, the memory tiles it spans plus
    :data:`GATHER_SLICE_BYTES` (single-gather programs on libtpu 0.0.21 cost within 10% of this)."""
    sizes = _int_list(ins.attrs, "slice_sizes")
    per_slice = 1
    for s in sizes:
        per_slice *= max(s, 1)
    operand = _operand_shape(comp, *ins.operands[0])
    return _elements(ins.shape) / per_slice * (_slice_tiles(operand, sizes) * _tile_bytes(operand) + GATHER_SLICE_BYTES)


def gather_bytes(mod: Module, comp: Computation) -> float:
    """Bytes of the gathers in ``comp`` and what it calls beyond their operands and outputs, by
    :func:`_model_gather` (for a fusion the compiler did not price alone)."""
    extra = 0.0
    for ins in comp.instrs:
        if ins.opcode == "gather" and len(ins.operands) > 1:
            boundary = tiled_bytes(ins.shape) + sum(tiled_bytes(_operand_shape(comp, n, s)) for n, s in ins.operands)
            extra += max(_model_gather(ins, comp) - boundary, 0.0)
        for _, callee in ins.called:
            extra += gather_bytes(mod, mod.computations[callee])
    return extra


def fused_flops(mod: Module, comp: Computation) -> float:
    total = 0.0
    for ins in comp.instrs:
        total += matmul_flops(ins, comp)
        if ins.opcode == "fusion":
            for _, callee in ins.called:
                total += fused_flops(mod, mod.computations[callee])
    return total


#: A layout's memory space other than 0 (HBM): ``S(1)`` VMEM, ``S(2)`` sync flags, ``S(6)`` SMEM.
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")


def _arrays(shape: str) -> list[tuple[int, bool]]:
    """(tiled bytes, on chip) of each array of an array or tuple shape."""
    return [(tiled_bytes(m.group(0)), bool(_ON_CHIP.search(m.group(3) or ""))) for m in _ARRAY_LAYOUT.finditer(shape)]


def hbm_bytes(ins: Instr, comp: Computation, nbytes: float) -> float:
    """The HBM part of ``nbytes``, an instruction's bytes as priced (:func:`instruction_bytes`, or a gather fusion's
    price): an asynchronous copy or slice moves its destination's bytes once per side of it in HBM; any other
    instruction keeps the share of its result's and operands' bytes that are not on chip."""
    if not nbytes:
        return 0.0
    if ins.opcode in ("copy-start", "slice-start"):
        parts = _arrays(ins.shape)  # copy-start: (destination, source, context); slice-start: ((source), dest, ctx)
        if len(parts) >= 2:
            (dest, dest_on), (_, src_on) = (parts[0], parts[1]) if ins.opcode == "copy-start" else (parts[1], parts[0])
            return float(dest * ((not dest_on) + (not src_on)))
    parts = _arrays(ins.shape) + [a for n, s in ins.operands for a in _arrays(_operand_shape(comp, n, s))]
    total = sum(b for b, _ in parts)
    return nbytes * sum(b for b, on in parts if not on) / total if total else nbytes


def instruction_bytes(ins: Instr, comp: Computation) -> float:
    """Bytes of one top-level instruction as the cost analysis counts them (every memory space), by the rules of the
    module docstring (gathers' extra not included)."""
    op = ins.opcode
    operands = [tiled_bytes(_operand_shape(comp, n, s)) for n, s in ins.operands]
    if op in SKIP_BYTES or op.endswith("-done") or op in CONTROL_FLOW:
        return 0.0
    if op.endswith("-start"):
        shape = ins.shape.strip()
        parts = _split_top(shape[1:-1]) if shape.startswith("(") else [shape]
        result = tiled_bytes(parts[1]) if len(parts) > 1 else tiled_bytes(shape)
        return 2.0 * result if op == "slice-start" else sum(operands) + result
    if op in ("slice", "dynamic-slice"):
        return 2.0 * tiled_bytes(ins.shape) + sum(operands[1:])
    if op == "dynamic-update-slice":
        return 2.0 * (operands[1] if len(operands) > 1 else 0) + sum(operands[2:])
    if op == "custom-call" and "AllocateBuffer" in ins.attrs:
        return 0.0
    return float(tiled_bytes(ins.shape) + sum(operands))
