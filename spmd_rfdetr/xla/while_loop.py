"""``while cond(*state): state = body(*state)`` as one XLA ``While`` op inside the lazy graph, a Python loop in eager.

The device matcher's loops (:mod:`spmd_rfdetr.model.matching`) run here: on the device they stop when every problem is
done, with no host read; the eager driver is their reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor


def while_loop(
    cond: Callable[..., Tensor], body: Callable[..., tuple[Tensor, ...]], state: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """``while cond(*state): state = body(*state)``: an XLA ``While`` on XLA tensors, a Python loop otherwise."""
    if state[0].device.type == "xla":
        return xla_while_loop(cond, body, state)
    return eager_while_loop(cond, body, tuple(state))


def eager_while_loop(
    cond: Callable[..., Tensor], body: Callable[..., tuple[Tensor, ...]], state: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """Reference driver for eager (CPU/CUDA) tensors: the same body in a Python loop."""
    while bool(cond(*state)):
        state = body(*state)
    return state


def xla_while_loop(
    cond: Callable[..., Tensor], body: Callable[..., tuple[Tensor, ...]], state: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """Run ``while cond(*state): state = body(*state)`` as one XLA ``While`` op inside the lazy graph.

    ``cond`` and ``body`` are traced once on placeholder tensors and lowered to HLO computations; tensors they
    create internally (scalars, aranges) become extra loop-invariant operands of the While, as in
    ``torch_xla.experimental.scan``.
    """
    import torch_xla  # only for XLA tensors: the eager driver (SciPy comparisons, benchmarks) needs no device
    import torch_xla.core.xla_builder as xb

    placeholders = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in state]

    def lower(fn: Callable[..., object], name: str) -> tuple[object, dict[int, int], dict[int, Tensor], int]:
        outputs = fn(*placeholders)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        ctx = torch_xla._XLAC.lowering.LoweringContext(name)
        ctx.build(outputs)
        computation = xb.computation_from_module_proto(name, ctx.hlo())
        state_params = {}
        for index, placeholder in enumerate(placeholders):
            param_id = ctx.tensor_parameter_id(placeholder)
            if param_id != -1:
                state_params[param_id] = index
        hoisted = {k: t for k, t in ctx.device_parameter_id_tensor_mapping().items() if k not in state_params}
        return computation, state_params, hoisted, len(outputs)

    body_comp, body_params, body_hoisted, num_out = lower(body, "assignment_body")
    cond_comp, cond_params, cond_hoisted, _ = lower(cond, "assignment_cond")
    assert num_out == len(state), "the loop body must return the whole state"

    operands = list(state)
    for params, hoisted in ((body_params, body_hoisted), (cond_params, cond_hoisted)):
        for param_id, tensor in sorted(hoisted.items()):
            params[param_id] = len(operands)
            operands.append(tensor)

    builder = xb.create_builder("assignment_while")
    while_params = [xb.mkparam(builder, k, shape) for k, shape in enumerate(xb.tensor_shape(operands))]

    def call(computation: object, params: dict[int, int], ops: Sequence[object]) -> object:
        return xb.Op.call(computation, [ops[params[k]] for k in range(len(params))])

    def cond_fn(*ops: object) -> object:
        return call(cond_comp, cond_params, ops).get_tuple_element(0)

    def body_fn(*ops: object) -> tuple[object, ...]:
        result = call(body_comp, body_params, ops)
        return tuple(result.get_tuple_element(k) for k in range(len(state))) + tuple(ops[len(state) :])

    computation = xb.Op.mkwhile(while_params, cond_fn, body_fn).build("assignment_while")
    outputs = torch_xla._XLAC._xla_user_computation("xla::assignment_while", operands, computation)
    return tuple(outputs[: len(state)])
