"""Bytes and FLOPs of a compiled (post-optimisation) HLO module by model component, from its op metadata.

Pure Python (no jax, no torch), like :mod:`spmd_rfdetr.aot.hlo_report`; :func:`bytes_by_component` gives the
JSON-ready table ``tpu_compile`` stores for each program under ``bytes_by_component``.

**What is counted.** Every *top-level* instruction (of ENTRY, of While bodies and conditions, of conditional branches
and ``call`` targets; never one inside a fusion) is charged the bytes the TPU's cost analysis charges it, as far as
its text shows them (libtpu 0.0.21; each rule checked on one-op programs compiled alone):

- an ordinary op or a fusion: its operands and its outputs at their tiled sizes, as the compiled layout pads them
  (``f32[384,145,145]{0,2,1:T(8,128)}`` is 384 x 152 x 145 x 4 bytes; ``f32[8192,16]{0,1:T(8,128)}`` needs no
  padding). Element-wise ops, a matmul, an attention score block and a reshape compiled alone cost exactly that;
  a reduction fusion that reads its input in several passes costs more (a softmax alone: 1.5x), which the text
  does not show;
- ``slice``/``dynamic-slice``/``slice-start``: twice the slice (it reads only what it returns),
  ``dynamic-update-slice`` twice the update (in place); an async ``*-start``: its operands and its result, not the
  operand alias its tuple carries; ``*-done``, parameters, constants, tuples, get-tuple-elements, bitcasts: nothing;
- a fusion that holds a gather: what the compiler charges that fusion compiled alone
  (:func:`gather_fusions`, priced by ``tpu_compile.fusion_costs``): the TPU prices a gather by the memory tiles it
  reads (one per index for an element-wise gather, some 4.6 KB for an f32 value), which the text does not show;
  without that price, :func:`~spmd_rfdetr.aot.op_costs.instruction_bytes` models it (tiles per slice +
  ``GATHER_SLICE_BYTES``).

libtpu's ``bytes accessed`` is the same kind of sum (a While body once, whatever its trip count); its
per-instruction figures are not exported, so the sum differs from it: ``vs_compiler`` says by how much (v5e.yaml on
v5e:2x4: within 10% for the training step and the eval). FLOPs are counted for ``dot`` and ``convolution`` ops
(fused ones too, charged to their fusion) from their shapes and windows (a batched matmul that XLA writes as a
convolution over a dilated window counts the pairs that read real input); the compiler's total also counts
element-wise ops (``matmul_share_of_compiler_flops``).

**HBM traffic.** The cost analysis counts accesses to on-chip memory too (a prefetch into VMEM, its reads, tensors
that live in VMEM between fusions); each row's ``hbm_bytes`` (and ``total_hbm_bytes``) is the part of its bytes
on HBM's side, read from the memory spaces in the compiled layouts (:func:`~spmd_rfdetr.aot.op_costs.hbm_bytes`).
That is the traffic HBM bandwidth limits; v5e.yaml's training step: about half of the compiler's count.

**Attribution.** Each instruction's metadata is read as one string, ``"<op_name>|<source file>:<line>"``: torch_xla
writes the innermost Python frame of every op with ``XLA_HLO_DEBUG=1`` (the ``aot`` verb sets it when it traces),
and the trace prefixes op names with the path of the ``nn.Module`` (or a scope of the step: the matcher's cost and
solver, the mask losses, clipping) that computed them, ``backward/<path>`` for what autograd ran for it
(:mod:`spmd_rfdetr.aot.labels`). The first rule of :data:`RULES` whose pattern matches names the component;
a backward op is matched without its ``backward/`` and charged to ``<component> (backward)``; nothing matches:
``other`` (``backward (unattributed)`` for an unlabelled ``*_backward`` op, ``other (no metadata)`` for none).

- A fusion is attributed by the metadata XLA gave it when it fused, which is its *root* instruction's (the op whose
  result the fusion returns): a fusion of a softmax with the matmul that feeds it goes to whichever op returns the
  result. A fusion without metadata of its own is read through its root, then its first fused instruction with some.
- An instruction without metadata (a copy, slice or prefetch the compiler inserted) is charged to the component of
  its nearest user with metadata, else of its nearest operand with some.
- Each While loop's top-level instructions are also summed per iteration (``loops``: bytes and matmul FLOPs per
  iteration, by component; a nested loop's instructions count in the innermost loop only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spmd_rfdetr.aot.hlo_report import CONTROL_FLOW, Computation, Instr, Module, _reach, parse_module
from spmd_rfdetr.aot.op_costs import fused_flops, gather_bytes, hbm_bytes, instruction_bytes, matmul_flops


#: (component, pattern) pairs, first match wins; the pattern is searched (``re.search``) in
#: ``"<op_name>|<source_file>:<line>"``, where the op name starts with the label the trace gave the op (the module
#: path, or a scope of the training step: :func:`spmd_rfdetr.aot.trace.step_scopes`) when it has one. A backward op
#: (label ``backward/<path>``) is matched without its ``backward/`` and charged to ``<component> (backward)``.
#: Source-file rules after the labels: for ops that carry no label (set-up, a program traced without labels).
RULES: list[tuple[str, str]] = [
    # the matcher's solver first: the device auction's While bodies are lowered late, after the optimizer has run,
    # and their ops carry the Python frame of whatever ran then (adam.py, step.py) besides their op name
    ("matcher: solver",
     r"^matcher\.solver/|xla__assignment_while|spmd_rfdetr/model/matching\.py|spmd_rfdetr/xla/while_loop\.py"),
    # the training step's own scopes (labels) and files
    ("EMA", r"^ema/|spmd_rfdetr/training/ema\.py"),
    ("AdamW", r"^adamw/|torch/optim/(adamw?|optimizer)\.py"),
    ("gradient clipping", r"^clip/|torch/nn/utils/clip_grad\.py"),
    ("LR schedule", r"^lr_schedule/|torch/optim/lr_scheduler\.py|spmd_rfdetr/training/optim\.py"),
    ("non-finite guard", r"^nonfinite_guard/|spmd_rfdetr/training/step\.py"),
    ("matcher: cost", r"^matcher\.(cost|mask_cost)/|rfdetr/models/matcher\.py"),
    # the criterion, by loss: masks by scope, GIoU and L1 by the line inside them (rfdetr's box_ops, F.l1_loss)
    ("criterion: masks", r"^criterion\.masks/|spmd_rfdetr/model/masks\.py"),
    ("criterion: GIoU", r"^criterion[^|]*\|.*(box_ops\.py:(1[2-9]\d)|torchvision/ops/boxes\.py)"),
    ("criterion: box (L1)", r"^criterion[^|]*\|.*torch/nn/functional\.py:37\d\d"),
    ("criterion: class", r"^criterion|spmd_rfdetr/model/loss\.py|rfdetr/models/criterion\.py"),
    # the model, by module path (labels), then by source file
    ("deformable cross-attention: sampler",
     r"cross_attn[^|]*\|.*(ms_deform_attn_func\.py|spmd_rfdetr/model/(xla_safe|deform_attention)\.py|"
     r"spmd_rfdetr/xla/mesh\.py|rfdetr/utilities/tensors\.py)|ms_deform_attn_func\.py|model/deform_attention\.py"),
    ("deformable cross-attention", r"\.cross_attn\b|ms_deform_attn\.py"),
    ("decoder self-attention", r"\.self_attn\b"),
    ("two-stage proposals", r"^transformer\.enc_|^transformer/"),
    ("heads", r"^(transformer\.decoder\.)?(class_embed|bbox_embed)|^segmentation_head|heads/segmentation\.py"),
    ("decoder (FFN, norms, reference points)", r"^transformer\.decoder|^transformer\b|rfdetr/models/transformer\.py"),
    ("projector", r"^backbone\.0\.projector|backbone/projector\.py"),
    ("DINOv2 backbone", r"^backbone|dinov2|rfdetr/models/backbone/|position_encoding\.py"),
    ("eval post-processing", r"postprocess\.py|spmd_rfdetr/eval/evaluator\.py"),
    ("input normalisation", r"spmd_rfdetr/data/pixels\.py"),
]

#: torch_xla's op names of what autograd ran, for ops without a label or a source line.
BACKWARD = re.compile(r"_backward")


@dataclass
class Charge:
    component: str
    bytes: float
    flops: float
    loop: str | None  # the While instruction whose body holds it (innermost), or None
    hbm: float = 0.0  # the HBM part of ``bytes`` (op_costs.hbm_bytes)


def metadata_key(ins: Instr, mod: Module) -> str:
    """``"<op_name>|<source_file>:<line>"`` of an instruction; a fusion without metadata: of its root, else of its
    first fused instruction that has some."""
    meta = ins.metadata
    if not meta.get("op_name") and ins.opcode == "fusion" and ins.called:
        fused = mod.computations[ins.called[0][1]]
        root = next((i for i in fused.instrs if i.is_root), None)
        meta = root.metadata if root is not None and root.metadata.get("op_name") else next(
            (i.metadata for i in fused.instrs if i.metadata.get("op_name")), {})
    source = meta.get("source_file", "")
    if source and "source_line" in meta:
        source = f"{source}:{meta['source_line']}"
    return f"{meta.get('op_name', '')}|{source}"


def attribute(key: str, rules: list[tuple[str, str]] | None = None) -> str:
    """The component of a metadata key (see :data:`RULES`); unmatched: ``other``, or ``backward (unattributed)`` for
    an op autograd ran, ``other (no metadata)`` for one without any."""
    backward = key.startswith("backward/")
    if backward:
        key = key[len("backward/"):]
    for component, pattern in RULES if rules is None else rules:
        if re.search(pattern, key):
            return f"{component} (backward)" if backward else component
    op_name, _, source = key.partition("|")
    if backward or (not source and BACKWARD.search(op_name)):
        return "backward (unattributed)"
    return "other" if op_name or source else "other (no metadata)"


def _loop_of(mod: Module) -> dict[str, str | None]:
    """Computation -> the innermost While instruction whose body/condition runs it (None: the ENTRY's level)."""
    owner: dict[str, str | None] = {mod.entry: None}
    todo = [mod.entry]
    while todo:
        name = todo.pop()
        for ins in mod.computations[name].instrs:
            if ins.opcode not in CONTROL_FLOW:
                continue
            for key, callee in ins.called:
                if callee in owner:
                    continue
                owner[callee] = ins.name if ins.opcode == "while" and key in ("body", "condition") else owner[name]
                todo.append(callee)
    return owner


def _inherited_keys(mod: Module, comp: Computation) -> dict[str, str]:
    """Metadata keys of ``comp``'s instructions; one without metadata (a copy, a slice or a prefetch the compiler
    inserted) takes the key of its nearest user that has one, else of its nearest operand that has one."""
    own = {ins.name: metadata_key(ins, mod) for ins in comp.instrs}
    users: dict[str, list[str]] = {}
    for ins in comp.instrs:
        for operand, _ in ins.operands:
            users.setdefault(operand, []).append(ins.name)
    operands = {ins.name: [o for o, _ in ins.operands] for ins in comp.instrs}
    out = dict(own)
    for name, key in own.items():
        if key != "|":
            continue
        for edges in (users, operands):
            seen, frontier, found = {name}, [name], None
            while frontier and found is None:
                nxt = []
                for n in frontier:
                    for m in edges.get(n, []):
                        if m in seen or m not in own:
                            continue
                        seen.add(m)
                        if own[m] != "|":
                            found = own[m]
                            break
                        nxt.append(m)
                    if found is not None:
                        break
                frontier = nxt
            if found is not None:
                out[name] = found
                break
    return out


def charges(mod: Module, rules: list[tuple[str, str]] | None = None,
            fusion_bytes: dict[str, float] | None = None) -> list[Charge]:
    """One :class:`Charge` per top-level instruction that moves bytes or does matmul FLOPs."""
    control = _reach(mod, [mod.entry], control_only=True)
    loop_of = _loop_of(mod)
    out = []
    for name in control:
        comp = mod.computations[name]
        keys = _inherited_keys(mod, comp)
        for ins in comp.instrs:
            nbytes = instruction_bytes(ins, comp)
            flops = matmul_flops(ins, comp)
            if ins.opcode == "fusion" or (ins.opcode.endswith("-start") and ins.called):
                for _, callee in ins.called:
                    priced = (fusion_bytes or {}).get(callee) if ins.opcode == "fusion" else None
                    if priced is not None:  # the compiler's own bytes for this fusion, compiled alone
                        nbytes = max(nbytes, priced)
                    else:
                        nbytes += gather_bytes(mod, mod.computations[callee])
                    flops += fused_flops(mod, mod.computations[callee])
            elif ins.opcode == "gather":
                nbytes += gather_bytes(mod, Computation("", False, [ins], comp.shapes))
            if nbytes or flops:
                out.append(Charge(attribute(keys[ins.name], rules), nbytes, flops, loop_of.get(name),
                                  hbm_bytes(ins, comp, nbytes)))
    return out


def bytes_by_component(text: str, compiler_bytes: float | None = None, compiler_flops: float | None = None,
                       images: int | None = None, rules: list[tuple[str, str]] | None = None,
                       fusion_bytes: dict[str, float] | None = None) -> dict:
    """The per-component table of a compiled module's text (per device, a While body once, as the compiler counts).

    ``compiler_bytes``/``compiler_flops``: the cost analysis's totals, for ``vs_compiler``; ``images``: images per
    device, for bytes per image; ``fusion_bytes``: the compiler's bytes of each :func:`gather_fusions` module compiled
    alone (:func:`spmd_rfdetr.aot.tpu_compile.fusion_costs`), by fusion computation; a gather fusion without one
    is priced by :func:`_model_gather`.
    """
    mod = parse_module(text)
    table: dict[str, dict[str, float]] = {}
    loops: dict[str, dict] = {}
    for c in charges(mod, rules, fusion_bytes):
        row = table.setdefault(c.component, {"bytes": 0.0, "flops": 0.0, "in_loops_bytes": 0.0, "hbm": 0.0})
        row["bytes"] += c.bytes
        row["hbm"] += c.hbm
        row["flops"] += c.flops
        if c.loop is not None:
            row["in_loops_bytes"] += c.bytes
            lp = loops.setdefault(c.loop, {"bytes_per_iteration": 0.0, "hbm_bytes_per_iteration": 0.0,
                                           "flops_per_iteration": 0.0, "components": {}})
            lp["bytes_per_iteration"] += c.bytes
            lp["hbm_bytes_per_iteration"] += c.hbm
            lp["flops_per_iteration"] += c.flops
            lp["components"][c.component] = lp["components"].get(c.component, 0.0) + c.bytes
    total_bytes = sum(r["bytes"] for r in table.values())
    total_flops = sum(r["flops"] for r in table.values())
    rows = []
    for component, r in sorted(table.items(), key=lambda kv: -kv[1]["bytes"]):
        row = {"component": component, "bytes": round(r["bytes"]), "share": round(r["bytes"] / total_bytes, 4)
               if total_bytes else 0.0, "matmul_flops": round(r["flops"]), "in_loops_bytes": round(r["in_loops_bytes"]),
               "hbm_bytes": round(r["hbm"])}
        if images:
            row["bytes_per_image"] = round(r["bytes"] / images)
            row["hbm_bytes_per_image"] = round(r["hbm"] / images)
        rows.append(row)
    for lp in loops.values():
        lp["components"] = {k: round(v) for k, v in sorted(lp["components"].items(), key=lambda kv: -kv[1])}
        lp["bytes_per_iteration"] = round(lp["bytes_per_iteration"])
        lp["hbm_bytes_per_iteration"] = round(lp["hbm_bytes_per_iteration"])
        lp["flops_per_iteration"] = round(lp["flops_per_iteration"])
    out = {"components": rows, "total_bytes": round(total_bytes),
           "total_hbm_bytes": round(sum(r["hbm"] for r in table.values())), "matmul_flops": round(total_flops),
           "loops": loops, "gather_fusions_priced_alone": len(fusion_bytes or {})}
    if compiler_bytes:
        out["compiler_bytes"] = compiler_bytes
        out["vs_compiler"] = round(total_bytes / compiler_bytes - 1, 4)
    if compiler_flops:
        out["matmul_share_of_compiler_flops"] = round(total_flops / compiler_flops, 4)
    return out


def hbm_share(table: dict) -> float:
    """The HBM part of a :func:`bytes_by_component` table's bytes (1.0 for an empty one): times the compiler's
    ``bytes accessed``, its count of HBM traffic, which the pricing rules' error does not shift."""
    return table["total_hbm_bytes"] / table["total_bytes"] if table["total_bytes"] else 1.0


def format_table(name: str, table: dict, out_lines: list[str] | None = None) -> str:
    """The table as text: component, GB per step (per device), share, bytes per image, matmul GFLOP."""
    lines = out_lines if out_lines is not None else []
    head = ["component", "GB/step", "share", "bytes/image", "HBM GB", "GFLOP (matmul)", "in loops GB"]
    rows = [head]
    for r in table["components"]:
        rows.append([r["component"], f"{r['bytes'] / 1e9:.3f}", f"{r['share']:.1%}",
                     f"{r['bytes_per_image']:.3g}" if "bytes_per_image" in r else "-",
                     f"{r['hbm_bytes'] / 1e9:.3f}", f"{r['matmul_flops'] / 1e9:.1f}",
                     f"{r['in_loops_bytes'] / 1e9:.3f}"])
    rows.append(["total", f"{table['total_bytes'] / 1e9:.3f}", "100%", "",
                 f"{table['total_hbm_bytes'] / 1e9:.3f}", f"{table['matmul_flops'] / 1e9:.1f}", ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines.append(f"{name}: bytes by component (per device per step, a While body once)")
    for row in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    if "vs_compiler" in table:
        lines.append(f"  sum {table['total_bytes']:.4g} bytes vs the compiler's {table['compiler_bytes']:.4g}: "
                     f"{table['vs_compiler']:+.1%}")
    for lname, lp in sorted(table["loops"].items(), key=lambda kv: -kv[1]["bytes_per_iteration"]):
        top = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in list(lp["components"].items())[:2])
        hbm = lp["hbm_bytes_per_iteration"] / 1e6
        lines.append(f"  loop {lname}: {lp['bytes_per_iteration'] / 1e6:.2f} MB ({hbm:.2f} of it HBM) and "
                     f"{lp['flops_per_iteration'] / 1e6:.2f} MFLOP per iteration ({top})")
    return "\n".join(lines)
