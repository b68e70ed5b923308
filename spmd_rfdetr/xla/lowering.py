"""A traced program as HLO for an ahead-of-time compiler (the ``aot`` verb): lowered, never compiled or run here."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch_xla
import torch_xla.core.xla_model as xm

_X = torch_xla._XLAC


def as_computed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, kept in the dtype its op computes (an optimization barrier) on the lazy XLA path: XLA otherwise folds
    a following upcast into the op (a bf16 matmul then writes float32, twice the bytes). Other devices and dynamo's
    trace: unchanged."""
    if tensor.device.type == "xla" and not torch.compiler.is_compiling():
        xm.optimization_barrier_([tensor])
    return tensor


@dataclass
class Lowered:
    """A traced program as HLO: a serialized ``HloModuleProto`` (GSPMD shardings annotated as torch_xla's own compile
    does), the parameter numbers of its donated inputs, its instruction count and its inputs' element types."""

    hlo: bytes
    donors: list[int]
    instructions: int
    input_types: dict[str, int]
    """How many inputs of each element type (``{"F32": 703, "S64": 6, "PRED": 2}``; TPUs have no ``F64``)."""
    own_outputs: dict[int, int] = field(default_factory=dict)
    """Donated parameter number -> the output that is the same tensor updated."""


def lower(outputs: list[torch.Tensor], donated: Sequence[tuple[torch.Tensor, int]] = (),
          name: str = "program") -> Lowered:
    """The HLO module torch_xla would compile for the pending ``outputs``, with the ``donated`` graph inputs marked
    (each as ``(value, index of the output that is its own update)``), for an ahead-of-time compiler; nothing
    compiles or runs here."""
    ctx = _X.lowering.LoweringContext(name)
    ctx.build(list(outputs))
    own = {ctx.tensor_parameter_id(value): output for value, output in donated}
    own.pop(-1, None)  # not a parameter of this graph
    text = ctx.hlo_text()
    instructions = sum(1 for line in text.splitlines() if line.strip() == "instructions {")
    return Lowered(ctx.hlo(), sorted(own), instructions, _input_types(text), own)


def _input_types(proto_text: str) -> dict[str, int]:
    """Element types of the entry's parameters, counted, from the module proto's text (its ``host_program_shape``)."""
    start = proto_text.index("\nhost_program_shape {\n")
    block = proto_text[start:proto_text.index("\n}\n", start)]
    return dict(Counter(re.findall(r"^  parameters \{\n    element_type: (\w+)$", block, flags=re.M)))
