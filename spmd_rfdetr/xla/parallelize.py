"""FSDP on the ``(data, fsdp)`` mesh as one step after the model is built: ``parallelize(model, mesh, cfg)``.

The sharding is data, as in big_vision: :data:`DEFAULT_RULES` is a list of ``(name regex, action)`` pairs; the first
rule whose pattern matches a parameter's name (``re.fullmatch``) decides its partition spec. An action is
``"fsdp"`` (shard the largest dimension divisible by the ``fsdp`` axis, if the parameter has at least
``mesh.fsdp_min_numel`` elements; else replicate), ``"replicate"``, or an explicit spec such as ``(None, "fsdp")``.
:func:`sharding_specs` turns rules and shapes into specs without any device (``plan`` uses it); :func:`parallelize`
applies them with ``mark_sharding`` (torchtitan's order: build the model -> set it up -> parallelize -> optimizer
state -> EMA copy).

What follows the parameters:
- AdamW state: created by :func:`spmd_rfdetr.xla.parallelize.init_optimizer_state` with ``zeros_like``, which does NOT carry a
  sharding (it comes back ``{replicated}``, measured on torch_xla 2.9), so :func:`parallelize` creates it and gives
  every ``exp_avg``/``exp_avg_sq`` its parameter's spec.
- Gradients: sharded like their parameter by GSPMD's propagation inside the step (tests/test_parallelize.py checks).
- EMA: :class:`spmd_rfdetr.training.ema.DeviceEMA` deep-copies the set-up model after this step; a deep copy keeps shardings.
- Checkpoints: :mod:`spmd_rfdetr.training.checkpoint` loads sharded tensors in place through torch_xla's SPMD planner.
Everything else (buffers, 0-d tensors) stays replicated.

Tested (``tests/test_parallelize.py``): on 8 CPU devices, data 2 x fsdp 4 trains the tiny model with the losses of
data 8 (relative 1e-5, 3 steps, replayed step), and parameter + AdamW bytes per device fall to about 1/4.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Sequence
from typing import Union

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs

from spmd_rfdetr.config.options import MeshOptions
from spmd_rfdetr.xla.mesh import FSDP_AXIS, fsdp_axis_size

log = logging.getLogger(__name__)

#: A partition spec: one mesh axis name (or ``None``: not split) per tensor dimension.
Spec = tuple[Union[str, None], ...]
#: What a rule does: ``"fsdp"``, ``"replicate"``, or an explicit :data:`Spec`.
Action = Union[str, Spec]
#: ``(regex over the parameter name, action)``; the first full match wins.
Rule = tuple[str, Action]

DEFAULT_RULES: tuple[Rule, ...] = (
    (r".*", "fsdp"),  # every parameter: its largest fsdp-divisible dimension, if it is large enough
)


def fsdp_spec(shape: Sequence[int], fsdp: int, min_numel: int) -> Spec:
    """Shard the largest dimension divisible by ``fsdp`` (the first of equals) along ``fsdp``; replicate a tensor
    under ``min_numel`` elements, with no such dimension, or when ``fsdp`` is 1."""
    replicated: Spec = (None,) * len(shape)
    if fsdp <= 1 or math.prod(shape) < min_numel:
        return replicated
    divisible = [d for d, size in enumerate(shape) if size % fsdp == 0 and size >= fsdp]
    if not divisible:
        return replicated
    dim = max(divisible, key=lambda d: (shape[d], -d))
    return tuple(FSDP_AXIS if d == dim else None for d in range(len(shape)))


def sharding_specs(named_shapes: Iterable[tuple[str, Sequence[int]]], fsdp: int, min_numel: int,
                   rules: Sequence[Rule] = DEFAULT_RULES) -> dict[str, Spec]:
    """The partition spec of every named shape under ``rules`` (no device needed).

    Raises:
        ValueError: a name no rule matches, or an explicit spec of the wrong rank.
    """
    compiled = [(re.compile(pattern), action) for pattern, action in rules]
    specs: dict[str, Spec] = {}
    for name, shape in named_shapes:
        shape = tuple(int(s) for s in shape)
        action = next((a for pattern, a in compiled if pattern.fullmatch(name)), None)
        if action is None:
            raise ValueError(f"no sharding rule matches parameter {name!r}: end the rules with ('.*', 'replicate')")
        if action == "fsdp":
            specs[name] = fsdp_spec(shape, fsdp, min_numel)
        elif action == "replicate":
            specs[name] = (None,) * len(shape)
        elif isinstance(action, tuple) and len(action) == len(shape):
            specs[name] = action
        else:
            raise ValueError(f"rule action {action!r} for {name!r} (shape {shape}): use 'fsdp', 'replicate' or a "
                             f"spec of {len(shape)} axis names / None")
    return specs


def shard_count(spec: Spec, axis_sizes: dict[str, int]) -> int:
    """Into how many pieces ``spec`` splits a tensor on a mesh of ``axis_sizes``."""
    return math.prod(axis_sizes[axis] for axis in spec if axis is not None)


def describe(specs: dict[str, Spec], shapes: dict[str, Sequence[int]] | None = None) -> str:
    """One line per sharded parameter (``name shape -> spec``) and a count of the replicated ones."""
    sharded = [name for name, spec in specs.items() if any(spec)]
    lines = [f"{name} {tuple(shapes[name]) if shapes else ''} -> {specs[name]}" for name in sharded]
    lines.append(f"{len(sharded)} parameters sharded along {FSDP_AXIS!r}, {len(specs) - len(sharded)} replicated")
    return "\n".join(lines)


def parallelize(model: torch.nn.Module, mesh: xs.Mesh, cfg: MeshOptions | None = None,
                optimizer: torch.optim.Optimizer | None = None,
                rules: Sequence[Rule] = DEFAULT_RULES) -> dict[str, Spec]:
    """Shard ``model``'s XLA parameters on ``mesh`` by ``rules`` (and, with ``optimizer``, create its AdamW state
    sharded like each parameter); returns the specs by parameter name. Call it after ``fabric.setup`` and before the
    EMA copy and the training step are built. On a mesh whose ``fsdp`` axis is 1 every parameter stays replicated.
    """
    cfg = cfg if cfg is not None else MeshOptions()
    params = dict(model.named_parameters())
    specs = sharding_specs(((n, p.shape) for n, p in params.items()), fsdp_axis_size(mesh), cfg.fsdp_min_numel, rules)
    sharded = {name for name, spec in specs.items() if any(spec) and params[name].device.type == "xla"}
    for name in sharded:  # the others stay as fabric.setup annotated them: replicated
        xs.mark_sharding(params[name], mesh, specs[name])  # in place: the optimizer's references stay valid
    if optimizer is not None and sharded:
        init_optimizer_state(optimizer)  # zeros_like: comes back replicated, whatever the parameter's sharding
        xm.wait_device_ops()  # its sync returns before the data exists; mark_sharding needs the data
        spec_of = {id(params[name]): specs[name] for name in sharded}
        for param, state in optimizer.state.items():
            for value in state.values():
                if id(param) in spec_of and isinstance(value, torch.Tensor) and value.shape == param.shape:
                    xs.mark_sharding(value, mesh, spec_of[id(param)])
    return specs


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW state on the device before the first step (torch creates it lazily inside step 1).

    Otherwise step 1 traces a graph without optimizer-state inputs and step 2 compiles the steady-state graph again.
    Under SPMD ``zeros_like`` comes back replicated whatever the parameter's sharding (measured); with an ``fsdp``
    axis :func:`~spmd_rfdetr.xla.parallelize.parallelize` has already created this state sharded like each parameter.
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        on_xla = [p for p in group["params"] if p.device.type == "xla"]
        if on_xla and not group.get("capturable", False) and not any(optimizer.state.get(p) for p in on_xla):
            # the same update, with the step count on the device: a CPU step count would turn each step's bias
            # corrections into Python numbers baked into the graph (a recompile, or a stale replay)
            group["capturable"] = True
            log.info("AdamW param group set to capturable=True (its step count lives on the XLA device)")
        for p in on_xla:
            if optimizer.state.get(p):
                continue
            state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
    torch_xla.sync()
