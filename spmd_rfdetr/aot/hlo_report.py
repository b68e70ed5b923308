"""Read a compiled (post-SPMD-partitioning) HLO module's text: computations, call graph, collectives, byte movers.

Pure Python (no jax, no torch). :func:`report` gives the JSON-ready summary ``tpu_compile`` stores for each program.

- A computation is *in a loop* when it is reachable from ENTRY through a While's ``body=``/``condition=``, directly or
  through calls, fusions, conditionals, async wrappers or ``to_apply`` (a computation reachable both ways counts as in a
  loop: it runs every iteration). Everything else reachable from ENTRY is the *body*.
- Collectives are counted once per op: ``all-gather`` and ``all-gather-start`` count one all-gather, ``-done`` none; a
  generic ``async-start`` is counted through the collective inside the computation it wraps.
- ``top_bytes``: the largest output + operand bytes among top-level instructions (those of ENTRY, of While bodies and
  conditions, of conditional branches and ``call`` targets; not of fusions or reducers), parameters, constants,
  tuples, get-tuple-elements, bitcasts and ``-done`` ops left out. Shapes in the compiled text are per-chip. Bytes are
  logical (elements x element size), not the padded tiles the TPU layouts (``{1,0:T(8,128)}``) allocate.
- Metadata: torch_xla's ``op_type`` does not survive the HLO -> StableHLO -> HLO round trip (``op_name`` and
  ``source_file``/``source_line`` do, with ``XLA_HLO_DEBUG=1`` at tracing).

:func:`parse_oom` reads libtpu's out-of-HBM compile error.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass, field

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OTHER_COLLECTIVES = ("collective-broadcast", "ragged-all-to-all")
#: opcodes whose called computations are part of the sequential program (their instructions are "top level")
CONTROL_FLOW = ("while", "conditional", "call")
#: not byte movers of their own (``-done`` ops: their bytes are counted at the ``-start``)
SKIP_BYTES = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "async-update", "async-done"})
_NO_OPERANDS = frozenset({"parameter", "constant", "iota", "rng-get-and-update-state"})

_INSTR = re.compile(r"\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([A-Za-z][\w\-.]*)\(")
_COMP = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_ATTR = re.compile(r"([\w.]+)=(\{[^{}]*\}|%?[\w.\-]+)")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]+)')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[tuple[str, str]]  # (name, inline shape or "")
    attrs: str  # everything after the operand list, less metadata/backend_config/frontend_attributes
    metadata: dict[str, str]
    backend_config: str = ""
    is_root: bool = False
    called: list[tuple[str, str]] = field(default_factory=list)  # (attribute, computation), filled by parse_module


@dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: list[Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)  # instruction name -> shape


@dataclass
class Module:
    computations: dict[str, Computation]
    entry: str


def _close(s: str, i: int) -> int:
    """Index just past the bracket that closes ``s[i]`` (``(`` or ``{``), skipping quoted strings."""
    depth, j, n = 0, i, len(s)
    while j < n:
        c = s[j]
        if c == '"':
            j += 1
            while j < n and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ValueError(f"unbalanced brackets in HLO: {s[i:i + 80]!r}")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(s):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p for p in parts if p.strip()]


def _take_attr(attrs: str, key: str) -> tuple[str, str]:
    """Remove ``key={...}`` or ``key="..."`` from ``attrs``: (its content, the rest)."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=([{{\"])", attrs)
    if not m:
        return "", attrs
    i = m.start(1)
    if attrs[i] == "{":
        j = _close(attrs, i)
    else:
        j = i + 1
        while j < len(attrs) and attrs[j] != '"':
            j += 2 if attrs[j] == "\\" else 1
        j += 1
    return attrs[i + 1:j - 1], attrs[:m.start()] + attrs[j:]


def parse_metadata(content: str) -> dict[str, str]:
    """``op_type="aten__add" op_name="..." source_line=12`` -> dict (strings unquoted)."""
    out = {}
    for k, v in _KV.findall(content):
        out[k] = v[1:-1].replace('\\"', '"').replace("\\\\", "\\") if v.startswith('"') else v
    return out


def parse_instruction(line: str) -> Instr | None:
    """One instruction line (``  [ROOT] %name = shape opcode(operands), attrs``), or None for anything else."""
    m = _INSTR.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _close(line, i)
    else:
        j = line.find(" ", i)
        j = len(line) if j < 0 else j
    shape = line[i:j]
    mo = _OPCODE.match(line, j)
    if not mo:
        return None
    k = mo.end() - 1
    e = _close(line, k)
    opcode = mo.group(1)
    operands = []
    if opcode not in _NO_OPERANDS:
        for part in _split_top(line[k + 1:e - 1]):
            part = re.sub(r"/\*.*?\*/", "", part).strip()
            shp, _, name = part.rpartition(" ")
            operands.append((name.lstrip("%"), shp.strip()))
    attrs = line[e:].lstrip(", ")
    meta, attrs = _take_attr(attrs, "metadata")
    backend, attrs = _take_attr(attrs, "backend_config")
    _, attrs = _take_attr(attrs, "frontend_attributes")
    return Instr(m.group(2), shape, opcode, operands, attrs, parse_metadata(meta), backend, bool(m.group(1)))


def parse_module(text: str) -> Module:
    """All computations of an HLO module's text, with each instruction's called computations resolved."""
    comps: dict[str, Computation] = {}
    cur: Computation | None = None
    entry = ""
    for line in text.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and not line.startswith("HloModule"):
                cur = comps.setdefault(m.group(2), Computation(m.group(2), bool(m.group(1))))
                entry = cur.name if cur.is_entry else entry
        elif line.startswith("}"):
            cur = None
        elif (ins := parse_instruction(line)) is not None:
            cur.instrs.append(ins)
            cur.shapes[ins.name] = ins.shape
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    for comp in comps.values():
        for ins in comp.instrs:
            for key, value in _ATTR.findall(ins.attrs):
                ins.called += [(key, c) for c in re.findall(r"%?([\w.\-]+)", value) if c in comps and c != comp.name]
    return Module(comps, entry)


def _bits(dtype: str) -> float:
    if dtype in ("pred",):
        return 8
    if dtype in ("token", "opaque"):
        return 0
    m = re.fullmatch(r"(?:bf|[fsuc])(\d+)\w*", dtype)  # f32, bf16, s4, c64, f8e4m3fn, f4e2m1fn
    return float(m.group(1)) if m else 0


def shape_bytes(shape: str) -> int:
    """Bytes of an array or (nested) tuple shape: ``(f32[64,1024]{1,0:T(8,128)}, s32[])`` -> 262148."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            n *= int(d) if d.isdigit() else 1
        total += n * _bits(dtype) / 8
    return int(total)


def collective_kind(opcode: str) -> str | None:
    """``all-gather`` / ``all-gather-start`` -> ``all-gather``; ``-done`` and non-collectives -> None."""
    base = opcode[:-6] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES or base in _OTHER_COLLECTIVES else None


def _reach(mod: Module, roots: list[str], control_only: bool = False) -> dict[str, bool]:
    """Computations reachable from ``roots`` -> whether any path to them passes a While's body/condition."""
    out: dict[str, bool] = {}
    seen: set[tuple[str, bool]] = set()
    todo = deque((r, False) for r in roots)
    while todo:
        name, loop = todo.popleft()
        if (name, loop) in seen:
            continue
        seen.add((name, loop))
        out[name] = out.get(name, False) or loop
        for ins in mod.computations[name].instrs:
            if control_only and ins.opcode not in CONTROL_FLOW:
                continue
            for key, callee in ins.called:
                todo.append((callee, loop or (ins.opcode == "while" and key in ("body", "condition"))))
    return out


def _source(meta: dict[str, str]) -> str:
    f = meta.get("source_file", "")
    f = f.split("site-packages/", 1)[-1]
    return f"{f}:{meta['source_line']}" if f and "source_line" in meta else f


def _count(mod: Module, comps) -> dict[str, int]:
    c: Counter[str] = Counter()
    for name in comps:
        for ins in mod.computations[name].instrs:
            if (kind := collective_kind(ins.opcode)) is not None:
                c[kind] += 1
    return {**{k: c.get(k, 0) for k in COLLECTIVES}, **{k: v for k, v in c.items() if k not in COLLECTIVES}}


def report(text: str, top: int = 15, top_sources: int = 10) -> dict:
    """The summary of a compiled module's text (see the module docstring for what is counted where)."""
    mod = parse_module(text)
    where = _reach(mod, [mod.entry])
    control = _reach(mod, [mod.entry], control_only=True)
    loops, sources = [], {}
    per_kind: dict[str, Counter] = {}
    movers = []
    for name, in_loop in where.items():
        comp = mod.computations[name]
        for ins in comp.instrs:
            if ins.opcode == "while":
                inner = _reach(mod, [c for k, c in ins.called if k in ("body", "condition")])
                trip = _TRIP.search(ins.backend_config)
                loops.append({"name": ins.name, "computation": name, "in_loop": in_loop,
                              "trip_count": int(trip.group(1)) if trip else None,
                              "collectives": _count(mod, inner)})
            if (kind := collective_kind(ins.opcode)) is not None:
                key = (ins.metadata.get("op_name", ""), ins.metadata.get("op_type", ""), _source(ins.metadata))
                per_kind.setdefault(kind, Counter())[key] += 1
            if name in control and ins.opcode not in SKIP_BYTES and not ins.opcode.endswith("-done"):
                nbytes = shape_bytes(ins.shape) + sum(shape_bytes(s or comp.shapes.get(o, "")) for o, s in ins.operands)
                movers.append((nbytes, name, ins, in_loop))
    for kind, counter in per_kind.items():
        sources[kind] = [{"op_name": n, "op_type": t, "source": s, "count": k}
                         for (n, t, s), k in counter.most_common(top_sources)]
    movers.sort(key=lambda m: -m[0])
    matmuls: Counter = Counter()  # dots and convolutions (fused ones too) by their first operand's element type
    for comp in mod.computations.values():
        for ins in comp.instrs:
            if ins.opcode in ("dot", "convolution") and ins.operands:
                name, inline = ins.operands[0]
                matmuls[(inline or comp.shapes.get(name, "")).split("[", 1)[0] or "?"] += 1
    top_bytes = [{"name": ins.name, "computation": comp, "opcode": ins.opcode, "shape": ins.shape[:200],
                  "bytes": nbytes, "op_name": ins.metadata.get("op_name", ""),
                  "op_type": ins.metadata.get("op_type", ""), "source": _source(ins.metadata), "in_loop": in_loop}
                 for nbytes, comp, ins, in_loop in movers[:top]]
    return {
        "collectives": {"body": _count(mod, [c for c, lp in where.items() if not lp]),
                        "in_loops": _count(mod, [c for c, lp in where.items() if lp])},
        "while_loops": len(loops),
        "matmuls": dict(matmuls),
        "loops": loops,
        "collective_sources": sources,
        "top_bytes": top_bytes,
    }


# --- the compiler's out-of-HBM message ------------------------------------------------------------------------------
_SZ = r"\d+(?:\.\d+)?\s*[KMGTP]?i?B?"
_OOM_FORMS = (  # (regex with need/avail groups, what it measures)
    (re.compile(rf"(?P<what>[A-Za-z][\w ]*?) \((?P<need>{_SZ})\) exceeds available HBM \((?P<avail>{_SZ})\)"), None),
    (re.compile(rf"Used (?P<need>{_SZ}) of (?P<avail>{_SZ}) hbm"), "HBM used (program + arguments)"),
    (re.compile(r"Allocation \(size=(?P<need>\d+)\) would exceed memory \(size=(?P<avail>\d+)\)"), "one allocation"),
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


_ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)")


def aliased_outputs(text: str) -> dict[int, int]:
    """Parameter number -> the output whose buffer it is, from a compiled module's ``input_output_alias`` header (the
    outputs of a tuple result; the compiler's pairing of donated inputs with outputs)."""
    header = text.split("\n", 1)[0]
    start = header.find("input_output_alias={")
    if start < 0:
        return {}
    block = header[start:_close(header, start + len("input_output_alias="))]
    return {int(param): int(output) for output, param in _ALIAS.findall(block)}


def parse_size(text: str) -> int:
    """``"15.75G"`` / ``"258.00M"`` / ``"512B"`` / ``"137438953472"`` -> bytes (libtpu's G is GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)i?B?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _allocations(msg: str, limit: int) -> list[dict]:
    """The "Largest program allocations in hbm" list: size, shape, operator, XLA label, allocation type."""
    out = []
    for block in re.split(r"\n\s*\d+\. (?=Size: )", msg)[1:limit + 1]:
        fields = dict(re.findall(r"^\s*(Size|Operator|Shape|XLA label|Allocation type): (.*)$", block, re.M))
        out.append({"size_bytes": parse_size(fields.get("Size", "0B")), "shape": fields.get("Shape", ""),
                    "operator": fields.get("Operator", ""), "label": fields.get("XLA label", "")[:300],
                    "type": fields.get("Allocation type", "")})
    return out


def parse_oom(message: str, limit: int = 15) -> dict | None:
    """The numbers of a ``RESOURCE_EXHAUSTED`` out-of-HBM compile error, or None when it is not one.

    libtpu words it three ways: ``HLO temporaries (16.67G) exceeds available HBM (15.75G)``, ``Used 22.00G of 15.75G
    hbm`` (followed by a usage breakdown and the largest allocations) and ``Allocation (size=N) would exceed memory
    (size=M)`` (one buffer larger than HBM).
    """
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    for rx, what in _OOM_FORMS:
        m = rx.search(message)
        hbm = what != "one allocation" or "space=" not in message or "space=hbm" in message  # not VMEM/SMEM
        if m and hbm:
            break
    else:
        return None
    out = {"needed_bytes": parse_size(m.group("need")), "available_bytes": parse_size(m.group("avail")),
           "what": what or m.group("what").strip()}
    # "    reserved        258.00M" / "    HLO temp         22.00G (100.0% utilization ...)"
    breakdown = {k.strip(): parse_size(v) for k, v in re.findall(rf"^\s+([A-Za-z][\w ]*?)\s{{2,}}({_SZ})(?=\s|$)",
                                                                  message, re.M)}
    if (o := re.search(rf"Output size ({_SZ}); shares ({_SZ}) with arguments", message)):
        breakdown["output"], breakdown["output shared with arguments"] = parse_size(o.group(1)), parse_size(o.group(2))
    if breakdown:
        out["breakdown"] = breakdown
    if (s := re.search(r"\[shape = '([^']*)'", message)):
        out["shape"] = s.group(1)
    # the list goes on with 512-byte buffers: keep the ones that matter
    out["detail"] = [a for a in _allocations(message, limit) if a["size_bytes"] * 1000 >= out["needed_bytes"]]
    return out
