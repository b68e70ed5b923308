"""Multi-head attention as one Pallas TPU kernel per pass (``trainer.fused_attention``; opt-in: no chip has run it).

Unfused, an attention writes its ``[L, L]`` scores, probabilities and their gradients to HBM between XLA's fusions:
the decoder's self-attention at v5e.yaml's shapes (``[16 x 13, 8 heads, 300, 32]`` per chip) moves ~8.5 GB a layer
with on-chip memory off. Here the forward reads ``q, k, v`` and writes the output; the backward reads those, the
output and its gradient and writes three gradients; every ``[L, L]`` matrix stays in the chip's VMEM. Heads stay
packed along the lanes (``[N, L, heads x d]``, the projections' own layout), so a head dimension of 32 is not padded to
128 lanes in HBM (torch_xla's flash attention takes ``[N, heads, L, d]``: 4x the bytes at ``d`` = 32) and no transpose
runs around the kernel. One grid step holds one sequence whole (RF-DETR's 300 queries, DINOv2's 145 and 580 tokens;
longer than :data:`MAX_LENGTH` the callers keep the XLA path), so no online softmax is needed; the backward recomputes
the probabilities and uses FlashAttention's ``dS = P * (dP - rowsum(dO * O))``. Scores, softmax and products
accumulate in float32; the probabilities enter the second product in the inputs' dtype (bf16), as the MXU reads them.

The kernels are JAX (Pallas). For a TPU (a chip, or ``aot``'s trace) they are lowered for the TPU explicitly (JAX's
default backend without a TPU is the CPU, which refuses Mosaic kernels) into the ``tpu_custom_call`` torch_xla puts
in the step; on any other backend the same kernels run in Pallas's interpret mode, lowered to plain XLA ops inside
the step (slow, but the kernels' own arithmetic: the CPU mesh's tests and the fine-tuning yardstick). On a mesh each
device runs them on its own rows (:func:`~spmd_rfdetr.xla.mesh.on_each_shard`: no collective). The TPU compiler
counts a kernel by the cost it declares (each tensor read or written once, in HBM tiles): v5e.yaml's step on v5e:2x4
with on-chip memory off, 74.8 -> 50.6 GB per chip (``benchmarks/README.md``). No chip has run them yet
(``tests/test_tpu_smoke.py``'s ``-m tpu`` check is what would turn them on by default).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spmd_rfdetr.config.backend import xla_backend
from spmd_rfdetr.xla.mesh import on_each_shard

#: The longest sequence the kernels take (one grid step holds a head's ``[L, L]`` float32 scores and the backward's
#: products in VMEM, v5e's scoped limit 16 MiB): longer ones keep the XLA path. Compiled: 1,029 tokens (v6e.yaml's
#: DINOv2 global layers, v6e); refused: 2,308 (v5e-keypoints.yaml's, v5e, "Ran out of memory in memory space vmem").
MAX_LENGTH = 1100

#: Mosaic IR version the pinned libtpu (0.0.21, torch_xla 2.9's) reads; JAX 0.7.1 writes 8 unless it sees an older
#: TPU runtime, which a process lowering without a TPU cannot.
MOSAIC_IR_VERSION = 7


def takes(length: int) -> bool:
    """Whether the kernels take a sequence of ``length`` (:data:`MAX_LENGTH`)."""
    return length <= MAX_LENGTH


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """``softmax(q_h k_h^T / sqrt(d)) v_h`` for every head ``h`` of ``[N, L, heads x d]`` XLA tensors (bf16 or float32,
    no mask), heads packed along the last axis in and out, as ``nn.MultiheadAttention``'s projections lay them out."""
    if not (q.shape == k.shape == v.shape and q.dim() == 3 and q.shape[-1] % heads == 0):
        raise ValueError(f"fused_attention takes q, k, v of one [N, L, heads x d] shape, got {q.shape}, {k.shape}, "
                         f"{v.shape} with {heads} heads")
    return _FusedAttention.apply(q, k, v, heads)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        (out,) = on_each_shard(lambda *t: _run(_forward_kernel, heads, t, 1), q, k, v)
        ctx.save_for_backward(q, k, v, out)
        ctx.heads = heads
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out = ctx.saved_tensors
        grads = on_each_shard(lambda *t: _run(_backward_kernel, ctx.heads, t, 3),
                              q, k, v, out, grad_out.to(q.dtype).contiguous())
        return (*grads, None)


def _run(kernel: Callable, heads: int, tensors: tuple[torch.Tensor, ...], outputs: int) -> tuple[torch.Tensor, ...]:
    """``kernel`` on XLA tensors (outputs of the first one's shape and dtype): for a TPU (a chip, or ``aot``'s trace)
    torch_xla's TPU custom call of the Mosaic kernel; on another backend (the CPU mesh: tests, the yardstick) the same
    kernel in Pallas's interpret mode, lowered to plain XLA ops inside the step."""
    import torch_xla

    specs = tuple((tuple(t.shape), str(t.dtype)) for t in tensors)
    if xla_backend() == "TPU":
        q = tensors[0]
        return tuple(torch_xla._XLAC._xla_tpu_custom_call(list(tensors), _mosaic_payload(kernel, heads, specs, outputs),
                                                          [q.shape] * outputs, [q.dtype] * outputs))
    return tuple(torch_xla._XLAC._xla_user_computation("xla::fused_attention_interpreted", list(tensors),
                                                       _interpreted(kernel, heads, specs, outputs)))


def _lowered(kernel: Callable, heads: int, specs: tuple, outputs: int, interpret: bool, **lower: Any) -> Any:
    """``kernel`` as a jitted JAX function of ``specs`` (shape, dtype name) arrays, lowered with ``lower``."""
    from torch_xla._internal.jax_workarounds import jax_env_context, jax_import_guard

    jax_import_guard()  # torch_xla holds the TPU before JAX looks for one (as torch_xla's own Pallas calls do)
    import jax
    import jax.experimental.pallas  # noqa: F401  (before the next: their modules import each other)
    import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)
    import jax.numpy as jnp

    structs = [jax.ShapeDtypeStruct(shape, getattr(jnp, dtype.removeprefix("torch."))) for shape, dtype in specs]
    fn = jax.jit(lambda *arrays: tuple(_call(kernel, heads, arrays, outputs, interpret)))
    with jax_env_context():
        return fn.trace(*structs).lower(**lower)


@functools.lru_cache(maxsize=None)
def _mosaic_payload(kernel: Callable, heads: int, specs: tuple, outputs: int) -> str:
    """The Mosaic kernel's backend config, lowered for the TPU (cached per shape: the step traces it every time)."""
    from torch_xla.experimental.custom_kernel import _extract_backend_config

    with _mosaic_ir_version(MOSAIC_IR_VERSION):
        lowered = _lowered(kernel, heads, specs, outputs, False, lowering_platforms=("tpu",))
    return _extract_backend_config(lowered.compiler_ir())


@functools.lru_cache(maxsize=None)
def _interpreted(kernel: Callable, heads: int, specs: tuple, outputs: int) -> Any:
    """The kernel in interpret mode as an XLA computation torch_xla can call (what ``torch_xla.core.xla_builder.call_jax``
    does, which also needs torchax)."""
    import torch_xla

    proto = _lowered(kernel, heads, specs, outputs, True).compiler_ir("hlo").as_serialized_hlo_module_proto()
    return torch_xla._XLAC._xla_op_computation_from_module_proto("fused_attention_interpreted", proto)


@contextlib.contextmanager
def _mosaic_ir_version(version: int) -> Iterator[None]:
    import jax._src.tpu_custom_call as tpu_custom_call

    original = tpu_custom_call.get_ir_version
    tpu_custom_call.get_ir_version = lambda ctx: version
    try:
        yield
    finally:
        tpu_custom_call.get_ir_version = original


# ---- the kernels (JAX): ``interpret=True`` runs them on the CPU (the tests, and ``_run`` off the TPU) ----

def attention_forward(q: Any, k: Any, v: Any, *, heads: int, interpret: bool = False) -> Any:
    """The attention's output for ``[N, L, heads x d]`` JAX arrays: one grid step per sequence."""
    return _call(_forward_kernel, heads, (q, k, v), 1, interpret)[0]


def attention_backward(q: Any, k: Any, v: Any, out: Any, grad_out: Any, *, heads: int,
                       interpret: bool = False) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` from the inputs, the forward's output and its gradient (all ``[N, L, heads x d]``)."""
    return tuple(_call(_backward_kernel, heads, (q, k, v, out, grad_out), 3, interpret))


def _call(kernel: Callable, heads: int, arrays: tuple, outputs: int, interpret: bool) -> list:
    """``pallas_call`` of ``kernel`` over ``arrays`` (``[N, L, heads x d]``): one sequence per grid step, ``outputs``
    arrays of the first one's shape and dtype."""
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    q = arrays[0]
    n, length, width = q.shape
    block = pl.BlockSpec((1, length, width), lambda i: (i, 0, 0))
    scale = 1.0 / math.sqrt(width // heads)
    products = 2 if kernel is _forward_kernel else 5  # [L, L] x [L, d] products per head (the backward recomputes s)
    tiled = n * _round_up(length, 32 // q.dtype.itemsize) * _round_up(width, 128) * q.dtype.itemsize  # HBM tiles
    cost = pl.CostEstimate(flops=2 * products * n * length * length * width, transcendentals=n * heads * length**2,
                           bytes_accessed=(len(arrays) + outputs) * tiled)
    return pl.pallas_call(
        functools.partial(kernel, heads=heads, scale=scale),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * outputs,
        grid=(q.shape[0],),
        in_specs=[block] * len(arrays),
        out_specs=[block] * outputs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=cost,  # the compiler counts a kernel by this: each tensor read or written once, in HBM tiles
        interpret=interpret,
    )(*arrays)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _unnormalised_probabilities(q: Any, k: Any, scale: float) -> tuple[Any, Any]:
    """``exp(s - max s)`` and its row sums for one head's ``[L, d]`` blocks, ``s = q k^T * scale`` in float32."""
    import jax
    import jax.numpy as jnp

    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return p, jnp.sum(p, axis=-1, keepdims=True)


def _forward_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, *, heads: int, scale: float) -> None:
    import jax.numpy as jnp

    d = q_ref.shape[-1] // heads
    for h in range(heads):
        c = slice(h * d, (h + 1) * d)
        v = v_ref[0, :, c]
        p, total = _unnormalised_probabilities(q_ref[0, :, c], k_ref[0, :, c], scale)
        o_ref[0, :, c] = (jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) / total).astype(o_ref.dtype)


def _backward_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, do_ref: Any, dq_ref: Any, dk_ref: Any,
                     dv_ref: Any, *, heads: int, scale: float) -> None:
    import jax
    import jax.numpy as jnp

    d = q_ref.shape[-1] // heads
    rows = (((0,), (0,)), ((), ()))  # a^T b: contract the first axes
    for h in range(heads):
        c = slice(h * d, (h + 1) * d)
        q, k, v, do = q_ref[0, :, c], k_ref[0, :, c], v_ref[0, :, c], do_ref[0, :, c]
        p, total = _unnormalised_probabilities(q, k, scale)
        p = p / total
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        delta = jnp.sum(do.astype(jnp.float32) * o_ref[0, :, c].astype(jnp.float32), axis=-1, keepdims=True)
        ds = (p * (dp - delta)).astype(q.dtype)
        dq_ref[0, :, c] = (jnp.dot(ds, k, preferred_element_type=jnp.float32) * scale).astype(dq_ref.dtype)
        dk_ref[0, :, c] = (jax.lax.dot_general(ds, q, rows, preferred_element_type=jnp.float32) * scale
                           ).astype(dk_ref.dtype)
        dv_ref[0, :, c] = jax.lax.dot_general(p.astype(do.dtype), do, rows,
                                              preferred_element_type=jnp.float32).astype(dv_ref.dtype)
