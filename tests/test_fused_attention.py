"""``trainer.fused_attention`` (:mod:`spmd_rfdetr.xla.fused_attention`): the Pallas kernels against PyTorch's attention
in Pallas's interpret mode on the CPU; the TPU compiler compiles them on a 4-chip mesh, each chip on its own rows, and
counts no ``[L, L]`` matrix in HBM; the step's attention modules take them only in a training trace; a chip whose
compiler refuses them is named before anything runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_xla

pytest.importorskip("jax", reason="the kernels are JAX's Pallas: pip install -e '.[aot]'")

from spmd_rfdetr.xla import fused_attention as fa  # noqa: E402

HEADS = 4


def _split(x: torch.Tensor) -> torch.Tensor:
    """``[N, L, heads x d]`` -> ``[N, heads, L, d]``, as ``nn.MultiheadAttention`` splits its projections."""
    n, length, width = x.shape
    return x.view(n, length, HEADS, width // HEADS).transpose(1, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernels_equal_pytorchs_attention_and_its_gradients(dtype: str) -> None:
    """Forward and backward kernels (interpret mode) against ``scaled_dot_product_attention`` in float64 on the heads
    split from the packed layout. 37 tokens: not a multiple of the TPU's 8 sublanes, as RF-DETR's 145 and 300 are not.
    float32 to rounding; bf16 inputs (the recipes') within what PyTorch's own bf16 attention is off by."""
    import jax.numpy as jnp

    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(3, 37, HEADS * 8, generator=g) for _ in range(4))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*(_split(t) for t in exact)).transpose(1, 2).flatten(2)
    want_grads = torch.autograd.grad(want, exact, grad.double())

    def as_jax(t: torch.Tensor) -> jnp.ndarray:
        return jnp.asarray(t.numpy(), getattr(jnp, dtype))

    out = fa.attention_forward(*map(as_jax, (q, k, v)), heads=HEADS, interpret=True)
    grads = fa.attention_backward(*map(as_jax, (q, k, v)), out, as_jax(grad), heads=HEADS, interpret=True)
    errors = [float(np.abs(np.asarray(a, np.float64) - b.detach().numpy()).max())
              for a, b in zip((out, *grads), (want, *want_grads))]
    if dtype == "float32":
        assert max(errors) < 1e-5, errors
        return
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]  # PyTorch's bf16 attention: the bound
    theirs = torch.nn.functional.scaled_dot_product_attention(*(_split(t) for t in inputs)).transpose(1, 2).flatten(2)
    their_grads = torch.autograd.grad(theirs, inputs, grad.bfloat16())
    bounds = [float((a.detach().double() - b).abs().max()) for a, b in zip((theirs, *their_grads), (want, *want_grads))]
    assert all(e <= 2 * b + 1e-3 for e, b in zip(errors, bounds)), (errors, bounds)  # output, dq, dk, dv


@pytest.mark.slow  # a libtpu compile in a child process
def test_the_kernels_compile_for_v5e_per_chip_with_no_score_matrix_in_hbm(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's self-attention shape (300 queries, 8 heads of 32) at 2 sequences per chip of v5e:2x2, forward
    and backward through the kernels, and the same through the XLA path (:mod:`spmd_rfdetr.model.attention`):
    libtpu compiles both with on-chip memory off. Each chip calls the kernels on its own rows (no collective), and
    the program's HBM traffic is that of its ``[N, L, heads x d]`` tensors: 7x below the XLA path's, whose score,
    probability and gradient matrices go through HBM."""
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr.aot.check import compile_traced
    from spmd_rfdetr.config.backend import TRACED_FOR_ENV
    from spmd_rfdetr.model.attention import attention
    from spmd_rfdetr.xla.lowering import lower
    from spmd_rfdetr.xla.mesh import build_mesh

    mesh, device = build_mesh(), torch_xla.device()
    heads, n, length, width = 8, 8, 300, 256

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(n, length, heads, width // heads).transpose(1, 2)

    variants = {"kernels": lambda q, k, v: fa.fused_attention(q, k, v, heads),
                "xla": lambda q, k, v: attention(split(q), split(k), split(v)).transpose(1, 2).reshape(n, length, width)}
    monkeypatch.setenv(TRACED_FOR_ENV, "TPU")  # traced for the chip, as `aot` traces: the Mosaic kernels
    programs, before = [], xs.get_global_mesh()
    xs.set_global_mesh(mesh)  # as Fabric does: the kernels' manual-sharding region is over the global mesh
    for name, fn in variants.items():
        inputs = [torch.randn(n, length, width, dtype=torch.bfloat16).to(device).requires_grad_() for _ in range(3)]
        for t in inputs:
            xs.mark_sharding(t, mesh, (("data", "fsdp"), None, None))
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        lowered = lower([out, *grads], name=name)
        torch_xla._XLAC._clear_pending_irs(str(device))
        (tmp_path / f"{name}.hlo.pb").write_bytes(lowered.hlo)
        programs.append({"name": name, "file": f"{name}.hlo.pb", "donors": [], "num_partitions": 4})
    xs.set_global_mesh(before)
    (tmp_path / "programs.json").write_text(json.dumps({"programs": programs}))
    kernels, xla = compile_traced("v5e:2x2", tmp_path, hbm_only=True)
    assert kernels["compiled"] and xla["compiled"], (kernels, xla)
    text = (tmp_path / "compiled" / "kernels.hlo.txt").read_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 2 and all("bf16[2,300,256]" in line for line in calls), calls  # forward, backward; 2 rows
    assert not any(op in text for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")), text[:2000]
    tensor = 2 * length * width * 2  # one [2, 300, 256] bf16 tensor per chip
    # the kernels read and write 12 such tensors (by the cost they declare); the program around them adds a layout copy
    # of each input and output at its boundary (a [2, 300, 256] parameter's layout is the compiler's choice)
    assert kernels["bytes_accessed"] < 30 * tensor < xla["bytes_accessed"] / 6, (kernels["bytes_accessed"],
                                                                                 xla["bytes_accessed"])


@pytest.mark.slow  # four small XLA CPU compiles, one with the interpreted kernels
def test_the_attention_modules_take_the_kernels_in_training_with_the_xla_paths_results() -> None:
    """``use_fused_attention`` marks the decoder's and DINOv2's attention modules; with gradients on, their XLA
    forward runs the kernels (interpreted on this CPU mesh) on the packed projections, with the XLA path's output
    and input, weight and bias gradients (float32); under ``no_grad`` (evaluation), and for a sequence longer than
    the kernels take, the XLA path runs."""
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    from spmd_rfdetr.model import xla_safe

    xla_safe.install()
    device = torch_xla.device()
    config = dinov2.WindowedDinov2WithRegistersConfig(hidden_size=64, num_attention_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    modules = {"decoder": torch.nn.MultiheadAttention(64, 4, batch_first=True),
               "backbone": dinov2.Dinov2WithRegistersSdpaSelfAttention(config)}
    x = torch.randn(4, 30, 64)

    def run(name: str, module: torch.nn.Module, grad: bool = True) -> tuple[list[torch.Tensor], str]:
        module = copy.deepcopy(module).to(device)
        inputs = x.to(device).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = module(inputs, inputs, inputs, need_weights=False)[0] if name == "decoder" else module(inputs)[0]
        text = torch_xla._XLAC._get_xla_tensors_hlo([out])
        if not grad:
            return [out.cpu()], text
        grads = torch.autograd.grad((out * out.detach().cos()).sum(), [inputs, *module.parameters()])
        return [t.cpu() for t in (out, *grads)], text

    for name, module in modules.items():
        xla, text = run(name, module)
        assert fa.__file__ not in text
        assert xla_safe.use_fused_attention(module) == 1
        fused, text = run(name, module)
        assert fa.__file__ in text, name
        errors = [float((a - b).abs().max() / b.abs().max().clamp(min=1.0)) for a, b in zip(fused, xla)]  # relative
        assert len(fused) == len(xla) > 3 and max(errors) < 1e-5, (name, errors)
        assert fa.__file__ not in run(name, module, grad=False)[1]
        with pytest.MonkeyPatch.context() as patch:  # a sequence longer than the kernels take: the XLA path
            patch.setattr(fa, "MAX_LENGTH", x.shape[1] - 1)
            assert fa.__file__ not in run(name, module)[1], name


def test_a_chip_whose_compiler_refuses_the_kernels_is_named_before_anything_runs() -> None:
    """libtpu's Mosaic refuses the kernels for TPU v3 (no bf16 matrix product: ``aot --topology v3:2x2`` failed with
    "Unsupported matmul RHS type on target"); ``aot`` says so for v3 before tracing, and lets v5e through."""
    from spmd_rfdetr.aot.check import aot_check
    from spmd_rfdetr.config.backend import fused_attention_chip_problem
    from spmd_rfdetr.config.options import ConfigError, RunConfig

    assert fused_attention_chip_problem(5) is None and fused_attention_chip_problem(3) is not None
    cfg = RunConfig()
    cfg.trainer.fused_attention = True
    with pytest.raises(ConfigError, match="refuses its Pallas kernels on TPU v3"):
        aot_check(cfg, "v3:2x2")
