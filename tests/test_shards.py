"""Work that stays on each device of a batch-sharded mesh: manual-sharding regions (the matcher's loop, gathers and
their gradients) and the rfdetr/torch functions rewritten so that nothing crosses chips (``spmd_rfdetr.model.xla_safe``).

Each is compared with the plain computation (eager CPU or upstream's own code); that nothing crosses chips is the TPU
compiler's to say (``tests/test_aot.py`` counts the collectives of the whole step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from spmd_rfdetr.model import row_lookups, xla_safe
from spmd_rfdetr.model.matching import solve_assignment
from spmd_rfdetr.xla.mesh import build_mesh, on_each_shard, take_rows

BATCH = ("data", "fsdp")


def sharded(t: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    x = t.to(torch_xla.device())
    xs.mark_sharding(x, mesh, (BATCH,) + (None,) * (x.dim() - 1))
    return x


def test_each_device_solves_its_own_problems_in_a_manual_region() -> None:
    mesh = build_mesh()
    xs.set_global_mesh(mesh)
    g = torch.Generator().manual_seed(0)
    cost, valid = torch.rand(16, 12, 4, generator=g), torch.rand(16, 4, generator=g) > 0.3
    expected, _ = solve_assignment(cost, valid)
    query, converged = on_each_shard(solve_assignment, sharded(cost, mesh), sharded(valid, mesh))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([query, converged])
    assert "SPMDFullToShardShape" in hlo and "SPMDShardToFullShape" in hlo and " while(" in hlo
    got = query.cpu()
    assert torch.equal(torch.where(valid, got, 0), torch.where(valid, expected, 0))
    assert bool(converged.cpu().all())


def test_the_matchers_recorded_rounds_are_the_solvers_on_the_hardest_problem() -> None:
    """``matcher_rounds`` in the step's stats: the search loop's rounds of each solve (its hardest problem's, on any
    device), summed over solves; the eager solver's own count is the reference."""
    from spmd_rfdetr.model.loss import StaticShapeMatcher
    from spmd_rfdetr.model.matching import solve_assignment_with_stats

    mesh = build_mesh()
    xs.set_global_mesh(mesh)
    g = torch.Generator().manual_seed(3)
    matcher = StaticShapeMatcher(cost_class=2, cost_bbox=5, cost_giou=2)
    expected = 0
    for queries in (12, 9):  # two solves of a step (e.g. the decoder's layers and the encoder's proposals)
        cost = torch.rand(16, queries, 6, generator=g).round(decimals=1)  # ties: rounds differ between problems
        valid = torch.rand(16, 6, generator=g) > 0.2
        rounds = solve_assignment_with_stats(cost, valid).rounds
        assert rounds.max() > rounds.min()
        expected += int(rounds.max())
        matcher._solve(sharded(cost, mesh), sharded(valid, mesh))
    stats = {name: int(value.cpu()) for name, value in matcher.pop_stats().items()}
    assert stats == {"matcher_unconverged": 0, "matcher_rounds": expected}
    assert matcher.pop_stats() == {}


def test_take_rows_and_its_gradient_equal_torch_gather() -> None:
    mesh = build_mesh()
    g = torch.Generator().manual_seed(1)
    rows, index, weight = torch.randn(8, 10, 3, generator=g), torch.randint(0, 10, (8, 6), generator=g), None
    weight = torch.randn(8, 6, 3, generator=g)
    cpu = rows.clone().requires_grad_()
    expected = cpu.gather(1, index[..., None].expand(8, 6, 3))
    (expected * weight).sum().backward()
    x = sharded(rows, mesh).requires_grad_()
    out = take_rows(x, sharded(index, mesh))
    (out * weight.to(x.device)).sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([x.grad])
    assert "SPMDFullToShardShape" in hlo and "scatter" in hlo  # the gradient's scatter-add ran per device
    assert torch.equal(out.detach().cpu(), expected.detach())
    assert torch.allclose(x.grad.cpu(), cpu.grad, atol=1e-6)


def test_a_gather_of_whole_rows_is_a_row_lookup_lazily_and_under_dynamo() -> None:
    """``row_gather`` (``torch.gather`` while ``row_gathers()`` is on: the eval program is traced inside it): a gather
    of rows by an index expanded along the last axis (rfdetr's ``idx.unsqueeze(-1).expand(..., C)``) is a row lookup
    on each device, traced lazily (``aot``) or by dynamo (``fit``), equal to ``torch.gather`` on the CPU; a gather
    along another axis stays ``torch.gather``."""
    mesh = build_mesh()
    xs.set_global_mesh(mesh)
    g = torch.Generator().manual_seed(4)
    source, rows = torch.randn(8, 10, 5, generator=g), torch.randint(0, 10, (8, 6), generator=g)
    columns = torch.randint(0, 5, (8, 10, 2), generator=g)

    def gathers(source: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (row_lookups.row_gather(source, 1, rows[..., None].expand(8, 6, 5)),
                row_lookups.row_gather(source, 2, columns))

    expected = (torch.gather(source, 1, rows[..., None].expand(8, 6, 5)), torch.gather(source, 2, columns))
    lazy = gathers(sharded(source, mesh), sharded(rows, mesh), sharded(columns, mesh))
    assert "SPMDFullToShardShape" in torch_xla._XLAC._get_xla_tensors_hlo([lazy[0]])
    assert "SPMDFullToShardShape" not in torch_xla._XLAC._get_xla_tensors_hlo([lazy[1]])
    compiled = torch.compile(gathers, backend="openxla", fullgraph=True)
    traced = compiled(sharded(source, mesh), sharded(rows, mesh), sharded(columns, mesh))
    for got in (lazy, traced):
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))


@pytest.mark.parametrize("padding_mode", ["zeros", "border"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_bilinear_sampling_by_rows_equals_rfdetrs_sampler(padding_mode: str, align_corners: bool) -> None:
    from rfdetr.utilities.tensors import _bilinear_grid_sample

    g = torch.Generator().manual_seed(5)
    value, grid = torch.randn(8, 4, 6, 5, generator=g), torch.rand(8, 7, 3, 2, generator=g) * 2.4 - 1.2
    v, p = value.clone().requires_grad_(), grid.clone().requires_grad_()
    expected = _bilinear_grid_sample(v, p, padding_mode, align_corners)  # upstream's own, on the CPU
    (expected * expected).sum().backward()
    mesh = build_mesh()
    xv, xp = sharded(value, mesh).requires_grad_(), sharded(grid, mesh).requires_grad_()
    out = row_lookups.bilinear_sample_rows(xv, xp, padding_mode, align_corners)
    (out * out).sum().backward()
    assert torch.allclose(out.detach().cpu(), expected.detach(), atol=1e-6)
    assert torch.allclose(xv.grad.cpu(), v.grad, atol=1e-5)
    assert torch.allclose(xp.grad.cpu(), p.grad, atol=1e-4)


@pytest.mark.parametrize("padding_mode", ["zeros", "border"])
def test_point_sampling_as_two_products_equals_rfdetrs_sampler(padding_mode: str) -> None:
    """The installed ``point_sample`` sampler (two products per map, ``separable_grid_sample``) on a sharded mesh
    against rfdetr's own sampler on the CPU (``F.grid_sample``): maps of one channel and of three, points inside, on
    the edges and outside; output and the maps' gradient (``point_sample``'s points are drawn, not learned)."""
    from rfdetr.models.heads import segmentation
    from rfdetr.utilities import tensors

    xla_safe.install()
    g = torch.Generator().manual_seed(7)
    for channels in (1, 3):
        value, grid = torch.randn(8, channels, 6, 5, generator=g), torch.rand(8, 9, 1, 2, generator=g) * 2.4 - 1.2
        v = value.clone().requires_grad_()
        expected = tensors._bilinear_grid_sample(v, grid, padding_mode, False)
        (expected * expected).sum().backward()
        mesh = build_mesh()
        xv, xp = sharded(value, mesh).requires_grad_(), sharded(grid, mesh)
        out = segmentation._bilinear_grid_sample(xv, xp, padding_mode, False)
        assert "SPMDFullToShardShape" not in torch_xla._XLAC._get_xla_tensors_hlo([out])  # not the row lookups
        (out * out).sum().backward()
        assert torch.allclose(out.detach().cpu(), expected.detach(), atol=1e-6)
        assert torch.allclose(xv.grad.cpu(), v.grad, atol=1e-5)


def test_deformable_attention_as_one_product_equals_rfdetrs_core() -> None:
    """The installed core on a sharded mesh (two levels, points inside, on the edges and outside) against rfdetr's
    own on the CPU (``F.grid_sample``): output and the gradients of the map, the locations and the weights."""
    from rfdetr.models.ops.functions import ms_deform_attn_core_pytorch as upstream
    from rfdetr.models.ops.modules import ms_deform_attn

    xla_safe.install()
    shapes = [(6, 7), (3, 4)]
    g = torch.Generator().manual_seed(3)
    value = torch.randn(4, 2, 8, sum(h * w for h, w in shapes), generator=g)
    locations = torch.rand(4, 5, 2, len(shapes), 3, 2, generator=g) * 1.6 - 0.3
    weights = torch.softmax(torch.randn(4, 5, 2, len(shapes) * 3, generator=g), -1)
    cpu = [t.clone().requires_grad_() for t in (value, locations, weights)]
    expected = upstream(cpu[0], torch.tensor(shapes), cpu[1], cpu[2], value_spatial_shapes_hw=shapes)
    (expected * expected).sum().backward()
    mesh = build_mesh()
    xla = [sharded(t, mesh).requires_grad_() for t in (value, locations.flatten(3, 4), weights)]  # XLA: rank <= 5
    out = ms_deform_attn.ms_deform_attn_core_pytorch(xla[0], torch.tensor(shapes), xla[1].view(locations.shape),
                                                     xla[2], value_spatial_shapes_hw=shapes)
    assert "SPMDFullToShardShape" not in torch_xla._XLAC._get_xla_tensors_hlo([out])  # not the row lookups
    (out * out).sum().backward()
    assert torch.allclose(out.detach().cpu(), expected.detach(), atol=1e-5)
    for got, want in zip(xla, cpu):
        assert torch.allclose(got.grad.cpu().view(want.shape), want.grad, atol=1e-4)


def _decoder_layer(group_detr: int) -> torch.nn.Module:
    from rfdetr.models.transformer import TransformerDecoderLayer

    class NoCrossAttention(torch.nn.Module):  # the self-attention block is under test; deformable attention is not
        def forward(self, query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return query * 0.5

    torch.manual_seed(0)
    layer = TransformerDecoderLayer(d_model=32, sa_nhead=4, ca_nhead=4, dim_feedforward=64, dropout=0.0,
                                    group_detr=group_detr, num_feature_levels=1, dec_n_points=2)
    layer.cross_attn = NoCrossAttention()
    return layer.train()


def test_group_detr_self_attention_regroups_batch_major_with_upstream_results() -> None:
    xla_safe.install()
    mesh = build_mesh()
    batch, groups, per_group = 8, 3, 5
    g = torch.Generator().manual_seed(2)
    tgt, pos = torch.randn(batch, groups * per_group, 32, generator=g), torch.randn(batch, groups * per_group, 32,
                                                                                    generator=g)
    reference_layer = _decoder_layer(groups)
    ref_tgt = tgt.clone().requires_grad_()
    reference = reference_layer(ref_tgt, None, query_pos=pos)  # upstream's code: CPU tensors are never rewritten
    reference.square().sum().backward()

    layer = copy.deepcopy(_decoder_layer(groups)).to(torch_xla.device())
    x = sharded(tgt, mesh).requires_grad_()
    out = layer(x, None, query_pos=sharded(pos, mesh))
    assert "aten::cat" not in torch_xla._XLAC._get_xla_tensors_text([out])  # regrouped by reshapes only
    out.square().sum().backward()
    assert torch.allclose(out.detach().cpu(), reference.detach(), atol=2e-6)
    assert torch.allclose(x.grad.cpu(), ref_tgt.grad, atol=1e-5)
    weight = layer.self_attn.in_proj_weight.grad.cpu()
    assert torch.allclose(weight, reference_layer.self_attn.in_proj_weight.grad, atol=1e-4, rtol=1e-5)


def test_batch_first_attention_equals_torch(monkeypatch) -> None:
    xla_safe.install()
    calls = []
    rewritten = xla_safe._batch_first_attention
    monkeypatch.setattr(xla_safe, "_batch_first_attention", lambda *a: calls.append(1) or rewritten(*a))
    torch.manual_seed(3)
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    q, v = torch.randn(8, 5, 32), torch.randn(8, 7, 32)
    reference, _ = attention(q, v, v, need_weights=False)
    out, weights = copy.deepcopy(attention).to(torch_xla.device())(*(t.to(torch_xla.device()) for t in (q, v, v)),
                                                                   need_weights=False)
    assert calls == [1] and weights is None
    assert torch.allclose(out.cpu(), reference.detach(), atol=1e-6)


def test_windowed_class_tokens_repeat_batch_major_with_upstream_values() -> None:
    from rfdetr.models.backbone.dinov2_with_windowed_attn import (WindowedDinov2WithRegistersConfig,
                                                                  WindowedDinov2WithRegistersEmbeddings)

    xla_safe.install()
    torch.manual_seed(4)
    config = WindowedDinov2WithRegistersConfig(hidden_size=16, patch_size=4, image_size=16, num_windows=2,
                                               num_register_tokens=0)
    embeddings = WindowedDinov2WithRegistersEmbeddings(config).train()
    pixels = torch.randn(8, 3, 16, 16)
    reference = embeddings(pixels)
    x = copy.deepcopy(embeddings).to(torch_xla.device())(sharded(pixels, build_mesh()))
    assert "aten::repeat" not in torch_xla._XLAC._get_xla_tensors_text([x])
    assert torch.allclose(x.detach().cpu(), reference.detach(), atol=1e-6)


def test_a_python_number_operand_is_taken_in_the_tensors_dtype_as_eager_pytorch() -> None:
    """torch_xla 2.9 compares a float32 tensor with a Python number in float64 (the number an f64 graph input, which
    TPUs lack): at x = float32(0.01), ``x >= 0.01`` is False there and True in eager PyTorch, which compares in the
    tensor's dtype. With ``xla_safe``'s kernels every comparison, ``isfinite`` and ``addcmul_``'s value (AdamW's
    ``1 - beta2``) give eager CPU's results with no f64 input in the program."""
    from spmd_rfdetr.xla.lowering import lower

    xla_safe._install_number_operands()  # (building any model installs it; idempotent)
    host = torch.tensor([0.01, 0.0099, 0.0101, -1.0, float("inf"), float("nan")])
    x = host.to(torch_xla.device())
    ops = [lambda t: t >= 0.01, lambda t: t > 0.01, lambda t: t <= 0.01, lambda t: t < 0.01, lambda t: t == 0.01,
           lambda t: t != 0.01, torch.isfinite, lambda t: torch.ones_like(t).addcmul_(t, t, value=0.001)]
    results = [op(x) for op in ops]
    types = lower(results).input_types
    assert types.get("F64", 0) == 0, types
    for op, got in zip(ops, results):
        torch.testing.assert_close(got.cpu(), op(host), rtol=0, atol=0, equal_nan=True)
