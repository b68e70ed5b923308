"""The AOT check's reading of compiled HLO text and of libtpu's out-of-HBM messages (pure Python: no jax, no TPU).

The snippets copy the shape of what libtpu 0.0.21 prints after SPMD partitioning (tiled layouts, operands without
shapes, async ``-start``/``-done`` pairs, ``/*index=N*/`` comments, metadata and JSON backend configs).
"""

from __future__ import annotations

import pytest

from spmd_rfdetr.aot import chips
from spmd_rfdetr.aot.hlo_report import parse_instruction, parse_module, parse_oom, parse_size, report, shape_bytes

SITE = "/root/venv/lib/python3.11/site-packages"

# ENTRY: an async all-reduce, a generic async reduce-scatter, a conditional whose branch holds a collective-permute,
# a call of %shared (also called inside the loop) and an outer While whose body holds an all-reduce, an all-gather
# inside a fusion, the call of %shared and a nested While with an all-to-all.
MODULE = f"""HloModule jit_step_spmd, is_scheduled=true, entry_computation_layout={{(f32[64,1024]{{1,0:T(8,128)}}, f32[1024]{{0:T(1024)}})->(f32[256]{{0:T(256)}}, f32[64,1024]{{1,0:T(8,128)}})}}, num_partitions=4

%add.clone (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[]{{:T(128)}} parameter(0)
  %y = f32[]{{:T(128)}} parameter(1)
  ROOT %add = f32[]{{:T(128)}} add(%x, %y)
}}

%fused_gather (param_0: f32[8,1024]) -> f32[32,1024] {{
  %param_0 = f32[8,1024]{{1,0:T(8,128)}} parameter(0)
  ROOT %all-gather.3 = f32[32,1024]{{1,0:T(8,128)}} all-gather(%param_0), channel_id=5, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, use_global_device_ids=true, metadata={{op_type="aten__cat" op_name="aten__cat" source_file="{SITE}/rfdetr/models/matcher.py" source_line=88}}
}}

%shared (s0: f32[8,1024]) -> f32[32,1024] {{
  %s0 = f32[8,1024]{{1,0:T(8,128)}} parameter(0)
  ROOT %all-gather.9 = f32[32,1024]{{1,0:T(8,128)}} all-gather(%s0), channel_id=9, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, metadata={{op_name="aten__stack"}}
}}

%wrapped_reduce_scatter (p0: f32[1024]) -> f32[256] {{
  %p0 = f32[1024]{{0:T(1024)}} parameter(0)
  ROOT %reduce-scatter.1 = f32[256]{{0:T(256)}} reduce-scatter(%p0), channel_id=7, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, to_apply=%add.clone, metadata={{op_name="grad_reduce_scatter"}}
}}

%branch_permute (b0: f32[1024]) -> f32[1024] {{
  %b0 = f32[1024]{{0:T(1024)}} parameter(0)
  %collective-permute-start = (f32[1024]{{0:T(1024)}}, f32[1024]{{0:T(1024)}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%b0), channel_id=3, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,0}}}}, metadata={{op_name="aten__roll"}}
  ROOT %collective-permute-done = f32[1024]{{0:T(1024)}} collective-permute-done(%collective-permute-start), metadata={{op_name="aten__roll"}}
}}

%branch_identity (b1: f32[1024]) -> f32[1024] {{
  ROOT %b1 = f32[1024]{{0:T(1024)}} parameter(0)
}}

%inner_body (ib: (s32[], f32[8,1024])) -> (s32[], f32[8,1024]) {{
  %ib = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) parameter(0)
  %gte.5 = f32[8,1024]{{1,0:T(8,128)}} get-tuple-element(%ib), index=1
  %all-to-all.2 = f32[8,1024]{{1,0:T(8,128)}} all-to-all(%gte.5), channel_id=11, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, metadata={{op_name="aten__permute"}}
  %gte.6 = s32[]{{:T(128)}} get-tuple-element(%ib), index=0
  ROOT %tuple.6 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) tuple(%gte.6, %all-to-all.2)
}}

%inner_cond (ic: (s32[], f32[8,1024])) -> pred[] {{
  %ic = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) parameter(0)
  %gte.7 = s32[]{{:T(128)}} get-tuple-element(%ic), index=0
  %constant.8 = s32[]{{:T(128)}} constant(3)
  ROOT %compare.2 = pred[]{{:T(512)}} compare(%gte.7, %constant.8), direction=LT
}}

%body.1 (wide.param: (s32[], f32[8,1024])) -> (s32[], f32[8,1024]) {{
  %wide.param = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) parameter(0)
  %gte.1 = f32[8,1024]{{1,0:T(8,128)}} get-tuple-element(%wide.param), index=1
  %fusion.2 = f32[32,1024]{{1,0:T(8,128)}} fusion(%gte.1), kind=kCustom, calls=%fused_gather, metadata={{op_name="aten__cat"}}, backend_config={{"flag_configs":[],"collective_algorithm_config":{{"debug":"\\nRing{{colors:2}} calls=%shared"}}}}
  %call.1 = f32[32,1024]{{1,0:T(8,128)}} call(%gte.1), to_apply=%shared
  %reduce.4 = f32[]{{:T(128)}} reduce(%fusion.2, %constant.1), dimensions={{0,1}}, to_apply=%add.clone
  %all-reduce.7 = f32[]{{:T(128)}} all-reduce(%reduce.4), channel_id=2, replica_groups={{{{0,1,2,3}}}}, to_apply=%add.clone, metadata={{op_type="aten__sum" op_name="aten__sum" source_file="{SITE}/rfdetr/models/matcher.py" source_line=91}}
  %gte.2 = s32[]{{:T(128)}} get-tuple-element(%wide.param), index=0
  %tuple.3 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) tuple(%gte.2, %gte.1)
  %while.2 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) while(%tuple.3), condition=%inner_cond, body=%inner_body
  %constant.1 = f32[]{{:T(128)}} constant(0)
  ROOT %tuple.4 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) tuple(%gte.2, %gte.1)
}}

%cond.1 (cp: (s32[], f32[8,1024])) -> pred[] {{
  %cp = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) parameter(0)
  %gte.3 = s32[]{{:T(128)}} get-tuple-element(%cp), index=0
  %constant.2 = s32[]{{:T(128)}} constant(5)
  ROOT %compare.1 = pred[]{{:T(512)}} compare(%gte.3, %constant.2), direction=LT
}}

%fused_mul (fp0: f32[64,1024], fp1: f32[64,1024]) -> f32[64,1024] {{
  %fp0 = f32[64,1024]{{1,0:T(8,128)}} parameter(0)
  %fp1 = f32[64,1024]{{1,0:T(8,128)}} parameter(1)
  ROOT %multiply.1 = f32[64,1024]{{1,0:T(8,128)}} multiply(%fp0, %fp1)
}}

ENTRY %main.99_spmd (param: f32[64,1024], param.1: f32[1024]) -> (f32[256], f32[64,1024]) {{
  %param = f32[64,1024]{{1,0:T(8,128)}} parameter(0), sharding={{devices=[4,1]0,1,2,3}}, metadata={{op_name="p0.3"}}
  %param.1 = f32[1024]{{0:T(1024)}} parameter(1), sharding={{replicated}}, metadata={{op_name="p1.4"}}
  %all-reduce-start = f32[1024]{{0:T(1024)}} all-reduce-start(%param.1), channel_id=1, replica_groups={{{{0,1,2,3}}}}, to_apply=%add.clone, metadata={{op_type="aten__mean" op_name="aten__mean" source_file="{SITE}/torch/nn/functional.py" source_line=12}}
  %all-reduce-done = f32[1024]{{0:T(1024)}} all-reduce-done(%all-reduce-start), metadata={{op_name="aten__mean"}}
  %async-start = ((f32[1024]{{0:T(1024)}}), f32[256]{{0:T(256)}}, u32[]{{:S(2)}}) async-start(%all-reduce-done), calls=%wrapped_reduce_scatter
  %async-done = f32[256]{{0:T(256)}} async-done(%async-start), calls=%wrapped_reduce_scatter
  %constant.5 = pred[]{{:T(512)}} constant(true)
  %conditional = f32[1024]{{0:T(1024)}} conditional(%constant.5, %all-reduce-done, %all-reduce-done), branch_computations={{%branch_permute, %branch_identity}}
  %bitcast.4 = f32[8,1024]{{1,0:T(8,128)}} bitcast(%conditional)
  %call.2 = f32[32,1024]{{1,0:T(8,128)}} call(%bitcast.4), to_apply=%shared
  %constant.6 = s32[]{{:T(128)}} constant(0)
  %tuple.0 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) tuple(%constant.6, %bitcast.4)
  %while.1 = (s32[]{{:T(128)}}, f32[8,1024]{{1,0:T(8,128)}}) while(%tuple.0), condition=%cond.1, body=%body.1, backend_config={{"known_trip_count":{{"n":"5"}}}}
  %broadcast.3 = f32[64,1024]{{1,0:T(8,128)}} broadcast(%param.1), dimensions={{1}}
  %fusion.9 = f32[64,1024]{{1,0:T(8,128)}} fusion(%param, /*index=1*/%broadcast.3), kind=kLoop, calls=%fused_mul, metadata={{op_name="aten__mul" source_file="{SITE}/torch/nn/modules/linear.py" source_line=134}}
  ROOT %tuple.9 = (f32[256]{{0:T(256)}}, f32[64,1024]{{1,0:T(8,128)}}) tuple(%async-done, %fusion.9)
}}
"""

ZERO = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def test_instruction_line() -> None:
    line = ('  ROOT %fusion.1 = (f32[1024]{0:T(1024)S(1)}, f32[]{:T(128)}) fusion(%copy.5, /*index=1*/%divide.1), '
            'kind=kOutput, calls=%fused_computation.5, metadata={op_name="a/\\"b\\"" source_file="x.py" '
            'source_line=7}, backend_config={"debug":"\\nRing{colors:2 }","n":"3"}')
    ins = parse_instruction(line)
    assert ins is not None and ins.is_root
    assert (ins.name, ins.opcode) == ("fusion.1", "fusion")
    assert ins.shape == "(f32[1024]{0:T(1024)S(1)}, f32[]{:T(128)})"
    assert ins.operands == [("copy.5", ""), ("divide.1", "")]
    assert ins.metadata == {"op_name": 'a/"b"', "source_file": "x.py", "source_line": "7"}
    assert "kind=kOutput, calls=%fused_computation.5" in ins.attrs and "metadata" not in ins.attrs
    assert '"n":"3"' in ins.backend_config and "colors" not in ins.attrs
    assert parse_instruction("%comp (p: f32[]) -> f32[] {") is None  # a computation header is not an instruction


def test_instruction_with_inline_operand_shapes() -> None:
    """torch_xla's own (pre-compile) text spells each operand's shape."""
    ins = parse_instruction("  %dot.8 = f32[256,1024]{1,0} dot(f32[256,1024]{1,0} %p3.7, f32[1024,1024]{0,1} "
                            "%transpose.6), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    assert ins is not None and ins.operands == [("p3.7", "f32[256,1024]{1,0}"), ("transpose.6", "f32[1024,1024]{0,1}")]
    assert parse_instruction("  %constant.2 = f32[2]{0} constant({1, 2})").operands == []


@pytest.mark.parametrize("shape, nbytes", [
    ("f32[64,1024]{1,0:T(8,128)S(1)}", 64 * 1024 * 4),
    ("bf16[8,128]{1,0:T(8,128)(2,1)}", 8 * 128 * 2),
    ("f32[]{:T(128)}", 4),
    ("pred[16]", 16),
    ("s4[10]", 5),
    ("f8e4m3fn[32]", 32),
    ("c64[2]", 16),
    ("s32[<=10]", 40),
    ("((f32[1024,1024]{1,0:T(8,128)}), f32[256,1024]{1,0}, s32[]{:S(2)})", 4 * (1024 * 1024 + 256 * 1024 + 1)),
    ("(token[], u32[])", 4),
])
def test_shape_bytes(shape: str, nbytes: int) -> None:
    assert shape_bytes(shape) == nbytes


def test_call_graph() -> None:
    mod = parse_module(MODULE)
    assert mod.entry == "main.99_spmd"
    assert len(mod.computations) == 12
    body = {i.name: i for i in mod.computations["body.1"].instrs}
    assert body["while.2"].called == [("condition", "inner_cond"), ("body", "inner_body")]
    assert body["fusion.2"].called == [("calls", "fused_gather")]  # not %shared, named in its backend_config
    entry = {i.name: i for i in mod.computations["main.99_spmd"].instrs}
    assert entry["conditional"].called == [("branch_computations", "branch_permute"),
                                           ("branch_computations", "branch_identity")]
    assert mod.computations["main.99_spmd"].shapes["broadcast.3"] == "f32[64,1024]{1,0:T(8,128)}"


def test_collectives_split_by_loops() -> None:
    r = report(MODULE)
    # async all-reduce once (-done not counted); reduce-scatter through its async wrapper; permute in a branch
    assert r["collectives"]["body"] == {**ZERO, "all-reduce": 1, "reduce-scatter": 1, "collective-permute": 1}
    # %shared is called from ENTRY and from the loop body: it runs every iteration, so it counts in the loops
    assert r["collectives"]["in_loops"] == {**ZERO, "all-reduce": 1, "all-gather": 2, "all-to-all": 1}


def test_while_loops() -> None:
    r = report(MODULE)
    assert r["while_loops"] == 2
    loops = {lp["name"]: lp for lp in r["loops"]}
    assert loops["while.1"]["trip_count"] == 5 and not loops["while.1"]["in_loop"]
    assert loops["while.1"]["collectives"] == {**ZERO, "all-reduce": 1, "all-gather": 2, "all-to-all": 1}
    assert loops["while.2"]["trip_count"] is None and loops["while.2"]["in_loop"]
    assert loops["while.2"]["collectives"] == {**ZERO, "all-to-all": 1}


def test_collective_sources() -> None:
    src = report(MODULE)["collective_sources"]
    assert src["all-reduce"] == [
        {"op_name": "aten__mean", "op_type": "aten__mean", "source": "torch/nn/functional.py:12", "count": 1},
        {"op_name": "aten__sum", "op_type": "aten__sum", "source": "rfdetr/models/matcher.py:91", "count": 1}]
    assert {(s["op_name"], s["source"]) for s in src["all-gather"]} == {("aten__cat", "rfdetr/models/matcher.py:88"),
                                                                        ("aten__stack", "")}
    assert src["reduce-scatter"] == [{"op_name": "grad_reduce_scatter", "op_type": "", "source": "", "count": 1}]
    assert src["collective-permute"][0]["count"] == 1  # the -start, not the -done as well


def test_top_bytes() -> None:
    top = report(MODULE, top=50)["top_bytes"]
    by_name = {t["name"]: t for t in top}
    first = top[0]
    assert (first["name"], first["bytes"], first["in_loop"]) == ("fusion.9", 3 * 64 * 1024 * 4, False)
    assert first["op_name"] == "aten__mul" and first["source"] == "torch/nn/modules/linear.py:134"
    assert [t["bytes"] for t in top] == sorted((t["bytes"] for t in top), reverse=True)
    assert by_name["broadcast.3"]["bytes"] == 64 * 1024 * 4 + 1024 * 4
    assert by_name["fusion.2"]["in_loop"] and by_name["all-to-all.2"]["in_loop"]  # nested while body: top level
    assert not by_name["collective-permute-start"]["in_loop"]  # a conditional branch is top level
    skipped = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "async-done", "all-reduce-done"}
    assert not skipped & {t["opcode"] for t in top}
    # fused, wrapped and to_apply computations are not top level
    assert not {"multiply.1", "all-gather.3", "reduce-scatter.1", "add"} & set(by_name)
    assert len(report(MODULE)["top_bytes"]) == 15


def test_no_entry_is_an_error() -> None:
    with pytest.raises(ValueError, match="ENTRY"):
        parse_module("HloModule m\n\n%c (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}\n")


OOM_USED = """XlaRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 22.00G of 15.75G hbm. Exceeded hbm capacity by 6.25G.

Total hbm usage >= 22.25G:
    reserved        258.00M\x20
    program          22.00G\x20
    arguments            0B\x20

Output size 0B; shares 0B with arguments.

Program hbm requirement 22.00G:
    global             512B
    HLO temp         22.00G (100.0% utilization: Unpadded (22.00G) Padded (22.00G), 0.0% fragmentation (186.5K))

  Largest program allocations in hbm:

  1. Size: 16.00G
     Operator: op_name="rng-bit-generator.29"
     Shape: u32[2097152,2,1024]{2,1,0:T(2,128)}
     Unpadded size: 16.00G
     XLA label: rng-bit-generator.3 = rng-bit-generator(custom-call.7), algorithm=rng_default
     Allocation type: HLO temp
     ==========================

  2. Size: 2.00G
     Operator: op_name="reshape.119"
     Shape: bf16[1048576,1024]{1,0:T(8,128)(2,1)}
     Unpadded size: 2.00G
     XLA label: reshape.7 = reshape(copy.7)
     Allocation type: HLO temp
     ==========================

  3. Size: 512B
     Shape: (f32[1024]{0:T(1024)S(1)}, f32[1024]{0:T(1024)}, u32[]{:S(2)})
     Unpadded size: 512B
     XLA label: copy-start.5 = copy-start(param.2)
     Allocation type: HLO temp
     ==========================
"""


def test_parse_oom_used_of() -> None:
    """libtpu 0.0.21's wording, as it failed a 22 GiB program on v5e."""
    oom = parse_oom(OOM_USED)
    assert oom is not None
    assert (oom["needed_bytes"], oom["available_bytes"]) == (22 * 2**30, int(15.75 * 2**30))
    assert oom["what"].startswith("HBM used")
    assert oom["breakdown"]["reserved"] == 258 * 2**20 and oom["breakdown"]["HLO temp"] == 22 * 2**30
    assert oom["breakdown"]["arguments"] == 0 and oom["breakdown"]["output"] == 0
    assert [d["size_bytes"] for d in oom["detail"]] == [16 * 2**30, 2 * 2**30]  # the 512-byte buffer is dropped
    assert oom["detail"][0]["shape"] == "u32[2097152,2,1024]{2,1,0:T(2,128)}"
    assert oom["detail"][0]["operator"] == 'op_name="rng-bit-generator.29"'
    assert oom["detail"][1]["label"] == "reshape.7 = reshape(copy.7)"


def test_parse_oom_other_wordings() -> None:
    oom = parse_oom("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Compilation failure: HLO temporaries "
                    "(16.67G) exceeds available HBM (15.75G). Consider reducing batch size.")
    assert oom == {"needed_bytes": int(16.67 * 2**30), "available_bytes": int(15.75 * 2**30),
                   "what": "HLO temporaries", "detail": []}
    msg = ("RESOURCE_EXHAUSTED: Allocation (size=34359738368) would exceed memory (size=33822867456) :: "
           "#allocation47 [shape = 'u32[4194304,2,1024]{2,1,0:T(2,128)}', space=hbm, size = 0xffffffffffffffff]")
    oom = parse_oom(msg)
    assert oom is not None and (oom["needed_bytes"], oom["available_bytes"]) == (34359738368, 33822867456)
    assert oom["what"] == "one allocation" and oom["shape"] == "u32[4194304,2,1024]{2,1,0:T(2,128)}"
    assert parse_oom(msg.replace("space=hbm", "space=vmem")) is None  # not HBM
    assert parse_oom("INVALID_ARGUMENT: Invalid sharding ... device 4 >= num_devices (4)") is None
    assert parse_oom(OOM_USED.replace("RESOURCE_EXHAUSTED", "INTERNAL")) is None


@pytest.mark.parametrize("text, nbytes", [("15.75G", int(15.75 * 2**30)), ("258.00M", 258 * 2**20), ("512B", 512),
                                          ("186.5K", 190976), ("137438953472", 137438953472), ("0B", 0)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_topology_names() -> None:
    assert chips.topology_kwargs("v5e:1x1") == {"topology_name": "v5e:1x1", "chips_per_host_bounds": (1, 1, 1)}
    assert chips.topology_kwargs("v5e:2x4") == {"topology_name": "v5e:2x4"}
    assert chips.topology_kwargs("v4:2x2x1") == {"topology_name": "v4:2x2x1", "chip_config_name": "megacore"}
    assert chips.topology_kwargs("v5litepod-4")["topology_name"] == "v5e:2x2"
    assert chips.topology_kwargs("v3:2x2x1")["topology_name"] == "v3:2x2"
    chip, name, dims = chips.parse_topology("v3-8")
    assert (name, dims, chip.devices_per_chip, chip.device_hbm_bytes) == ("v3:2x2", (2, 2), 2, 16 * 2**30)
    for bad in ("v7x:2x2", "v4:2x2", "v5e", "v5e:0x2", "tpu"):
        with pytest.raises(chips.TopologyError, match="valid names: v5e:1x1, v5e:2x2"):
            chips.parse_topology(bad)


# --- bytes by component (spmd_rfdetr.aot.components) -----------------------------------------------------------------
# A compiled step in miniature, as libtpu 0.0.21 prints one of the aot verb's labelled programs: the trace's module
# paths in the op names (``backbone.0.encoder...``, ``backward/...``, ``matcher.solver/...``), source files, a fusion
# without metadata of its own, compiler-inserted prefetches and slices without any, a gather fusion and a While loop.
ADAM = f"{SITE}/torch/optim/adam.py"
STEP = f"""HloModule jit_train_step, is_scheduled=true, num_partitions=1

%fused_mm (p0: bf16[16,64], p1: bf16[64,32]) -> bf16[16,32] {{
  %p0 = bf16[16,64]{{1,0:T(8,128)(2,1)}} parameter(0)
  %p1 = bf16[64,32]{{1,0:T(8,128)(2,1)}} parameter(1)
  ROOT %dot.1 = bf16[16,32]{{1,0:T(8,128)(2,1)}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="backbone.0.encoder.encoder.layer.0.mlp.fc1/aten__mm" source_file="{SITE}/torch/nn/modules/linear.py" source_line=134}}
}}

%fused_softmax_grad (s0: f32[8,32]) -> f32[8,32] {{
  %s0 = f32[8,32]{{1,0:T(8,128)}} parameter(0)
  ROOT %exponential.1 = f32[8,32]{{1,0:T(8,128)}} exponential(%s0), metadata={{op_name="backward/transformer.decoder.layers.0.self_attn/aten___softmax_backward_data"}}
}}

%fused_norm_grad (n0: f32[8,32]) -> f32[8,32] {{
  %n0 = f32[8,32]{{1,0:T(8,128)}} parameter(0)
  ROOT %negate.1 = f32[8,32]{{1,0:T(8,128)}} negate(%n0)
}}

%fused_rows (g0: f32[4,16], g1: s32[10,1]) -> f32[10,16] {{
  %g0 = f32[4,16]{{1,0:T(8,128)}} parameter(0)
  %g1 = s32[10,1]{{1,0:T(8,128)}} parameter(1)
  ROOT %gather.1 = f32[10,16]{{1,0:T(8,128)}} gather(%g0, %g1), offset_dims={{1}}, collapsed_slice_dims={{0}}, start_index_map={{0}}, index_vector_dim=1, slice_sizes={{1,16}}
}}

%solver_body (b: (s32[], f32[4,100])) -> (s32[], f32[4,100]) {{
  %b = (s32[]{{:T(128)}}, f32[4,100]{{1,0:T(4,128)}}) parameter(0)
  %gte.1 = s32[]{{:T(128)}} get-tuple-element(%b), index=0
  %gte.2 = f32[4,100]{{1,0:T(4,128)}} get-tuple-element(%b), index=1
  %multiply.1 = f32[4,100]{{1,0:T(4,128)}} multiply(%gte.2, %gte.2), metadata={{op_name="matcher.solver/xla__assignment_while/call.7/aten__mul" source_file="/work/spmd_rfdetr/model/matching.py" source_line=240}}
  %add.2 = s32[]{{:T(128)}} add(%gte.1, %gte.1), metadata={{op_name="matcher.solver/xla__assignment_while/call.7/aten__add"}}
  ROOT %tuple.1 = (s32[]{{:T(128)}}, f32[4,100]{{1,0:T(4,128)}}) tuple(%add.2, %multiply.1)
}}

%solver_cond (c: (s32[], f32[4,100])) -> pred[] {{
  %c = (s32[]{{:T(128)}}, f32[4,100]{{1,0:T(4,128)}}) parameter(0)
  %gte.3 = s32[]{{:T(128)}} get-tuple-element(%c), index=0
  ROOT %compare.1 = pred[]{{:T(512)}} compare(%gte.3, %gte.3), direction=LT, metadata={{op_name="matcher.solver/xla__assignment_while/call.7/aten__lt"}}
}}

ENTRY %main.1_spmd (param.0: bf16[16,64], param.1: bf16[64,32], param.2: f32[8,32], param.3: f32[8,16], param.4: s32[10,1], param.5: (s32[], f32[4,100])) -> (bf16[16,32], f32[256], f32[10,16], f32[8,32]) {{
  %param.0 = bf16[16,64]{{1,0:T(8,128)(2,1)}} parameter(0), metadata={{op_name="xla__device_data"}}
  %param.1 = bf16[64,32]{{1,0:T(8,128)(2,1)}} parameter(1)
  %param.2 = f32[8,32]{{1,0:T(8,128)}} parameter(2)
  %param.3 = f32[8,16]{{1,0:T(8,128)}} parameter(3)
  %param.4 = s32[10,1]{{1,0:T(8,128)}} parameter(4)
  %param.5 = (s32[]{{:T(128)}}, f32[4,100]{{1,0:T(4,128)}}) parameter(5)
  %fusion.1 = bf16[16,32]{{1,0:T(8,128)(2,1)}} fusion(%param.0, %param.1), kind=kOutput, calls=%fused_mm, metadata={{op_name="backbone.0.encoder.encoder.layer.0.mlp.fc1/aten__mm" source_file="{SITE}/torch/nn/modules/linear.py" source_line=134}}
  %fusion.2 = f32[8,32]{{1,0:T(8,128)}} fusion(%param.2), kind=kLoop, calls=%fused_softmax_grad
  %fusion.4 = f32[8,32]{{1,0:T(8,128)}} fusion(%fusion.2), kind=kLoop, calls=%fused_norm_grad, metadata={{op_name="aten__native_layer_norm_backward"}}
  %copy-start.1 = (f32[8,32]{{1,0:T(8,128)S(1)}}, f32[8,32]{{1,0:T(8,128)}}, u32[]{{:S(2)}}) copy-start(%fusion.4)
  %copy-done.1 = f32[8,32]{{1,0:T(8,128)S(1)}} copy-done(%copy-start.1)
  %add.1 = f32[8,32]{{1,0:T(8,128)}} add(%copy-done.1, %copy-done.1), metadata={{op_name="aten__add" source_file="{ADAM}" source_line=400}}
  %reshape.1 = f32[256]{{0:T(256)}} reshape(%add.1), metadata={{op_name="transformer.decoder.layers.0.cross_attn/aten__view" source_file="{SITE}/rfdetr/models/ops/functions/ms_deform_attn_func.py" source_line=80}}
  %slice-start.1 = ((f32[8,16]{{1,0:T(8,128)}}), f32[4,16]{{1,0:T(8,128)S(1)}}, s32[]{{:S(2)}}) slice-start(%param.3), slice={{[0:4], [0:16]}}
  %slice-done.1 = f32[4,16]{{1,0:T(8,128)S(1)}} slice-done(%slice-start.1)
  %fusion.3 = f32[10,16]{{1,0:T(8,128)}} fusion(%slice-done.1, %param.4), kind=kCustom, calls=%fused_rows, metadata={{op_name="criterion/aten__gather" source_file="/work/spmd_rfdetr/model/loss.py" source_line=300}}
  %while.1 = (s32[]{{:T(128)}}, f32[4,100]{{1,0:T(4,128)}}) while(%param.5), condition=%solver_cond, body=%solver_body
  ROOT %tuple.9 = (bf16[16,32]{{1,0:T(8,128)(2,1)}}, f32[256]{{0:T(256)}}, f32[10,16]{{1,0:T(8,128)}}, f32[8,32]{{1,0:T(8,128)}}) tuple(%fusion.1, %reshape.1, %fusion.3, %fusion.4)
}}
"""

#: Bytes per component, by hand from the rules of spmd_rfdetr.aot.components: arrays at their tiled sizes
#: (``f32[8,32]{1,0:T(8,128)}`` is 8 x 128 x 4 bytes, ``bf16[64,32]`` 64 x 128 x 2).
GATHER = 10 * (4096 + 512)  # 10 rows of 16 f32, each within one (8,128) f32 tile of 4 KiB, + 512 bytes a slice
STEP_BYTES = {
    "DINOv2 backbone": 4096 + 16384 + 4096,  # the matmul fusion: operands and output
    "decoder self-attention (backward)": 4096 + 4096,  # no metadata of its own: its root's (a labelled backward op)
    "backward (unattributed)": 4096 + 4096,  # a *_backward op without a label or a source line
    "AdamW": 3 * 4096 + 2 * 4096,  # adam.py's add, and the prefetch (copy-start) that feeds it (inherited)
    "deformable cross-attention: sampler": 4096 + 256 * 4,  # a reshape: operand and result
    "criterion: class": 2 * 4096 + GATHER,  # the slice-start feeding the gather (inherited), the gather fusion
    "matcher: solver": 3 * 2048 + 3 * 4 + 4 + 4 + 1,  # the While body (multiply, add) and condition (compare)
}
#: Their HBM part: AdamW's prefetch reads 4 KiB of HBM into VMEM (S(1)) and its add reads that copy twice on chip
#: and writes 4 KiB to HBM.
ADAM_HBM_BYTES = 4096 + 4096


def test_bytes_by_component_attributes_and_sums() -> None:
    from spmd_rfdetr.aot.components import bytes_by_component

    total = sum(STEP_BYTES.values())
    table = bytes_by_component(STEP, compiler_bytes=total * 1.05, compiler_flops=70000, images=2)
    got = {r["component"]: r["bytes"] for r in table["components"]}
    assert got == STEP_BYTES
    assert table["total_bytes"] == total and table["vs_compiler"] == round(1 / 1.05 - 1, 4)  # -4.8%: within 10%
    rows = {r["component"]: r for r in table["components"]}
    assert rows["DINOv2 backbone"]["matmul_flops"] == 2 * 16 * 32 * 64 and table["matmul_flops"] == 2 * 16 * 32 * 64
    assert rows["AdamW"]["bytes_per_image"] == STEP_BYTES["AdamW"] / 2
    assert rows["AdamW"]["hbm_bytes"] == ADAM_HBM_BYTES and rows["DINOv2 backbone"]["hbm_bytes"] == rows[
        "DINOv2 backbone"]["bytes"]  # nothing of the matmul's is on chip
    assert abs(sum(r["share"] for r in table["components"]) - 1) < 1e-3
    assert [r["bytes"] for r in table["components"]] == sorted(STEP_BYTES.values(), reverse=True)
    # the While loop: per iteration, apart, and counted once in the total (as the compiler counts it)
    solver = STEP_BYTES["matcher: solver"]
    assert table["loops"] == {"while.1": {"bytes_per_iteration": solver, "hbm_bytes_per_iteration": solver,
                                          "flops_per_iteration": 0,
                                          "components": {"matcher: solver": solver}}}
    assert rows["matcher: solver"]["in_loops_bytes"] == STEP_BYTES["matcher: solver"]


def test_gather_fusion_priced_by_the_compiler() -> None:
    """A gather fusion the compiler priced alone (tpu_compile.fusion_costs) is charged that, not the model."""
    from spmd_rfdetr.aot.components import bytes_by_component
    from spmd_rfdetr.aot.op_costs import gather_fusions

    modules = gather_fusions(STEP)
    assert list(modules) == ["fused_rows"]
    assert "ENTRY fused_rows" in modules["fused_rows"] and "T(8,128)" not in modules["fused_rows"]
    table = bytes_by_component(STEP, fusion_bytes={"fused_rows": 123456})
    assert {r["component"]: r["bytes"] for r in table["components"]}["criterion: class"] == 2 * 4096 + 123456


@pytest.mark.parametrize("key, component", [
    ("transformer.decoder.layers.2.self_attn/aten__bmm|/x/torch/functional.py:12", "decoder self-attention"),
    ("backward/transformer.decoder.layers.2.self_attn/aten__bmm|", "decoder self-attention (backward)"),
    ("transformer.decoder.layers.0.cross_attn/aten__index_select|/work/spmd_rfdetr/xla/mesh.py:150",
     "deformable cross-attention: sampler"),
    ("transformer.decoder.layers.0.cross_attn.value_proj/aten__mm|/x/torch/nn/modules/linear.py:134",
     "deformable cross-attention"),
    ("backbone.0.projector.stages.0.0.cv1.conv/aten__convolution_overrideable|", "projector"),
    ("transformer.enc_output.0/aten__mm|", "two-stage proposals"),
    ("transformer/aten__topk|/x/rfdetr/models/transformer.py:520", "two-stage proposals"),
    ("class_embed/aten__mm|", "heads"),
    ("transformer.decoder.bbox_embed.0.layers.1/aten__mm|", "heads"),
    ("matcher.cost/aten__cdist|/x/rfdetr/models/matcher.py:80", "matcher: cost"),
    ("criterion/aten__sub|/x/rfdetr/utilities/box_ops.py:130", "criterion: GIoU"),
    ("criterion/aten__abs|/x/torch/nn/functional.py:3770", "criterion: box (L1)"),
    ("criterion.masks/aten__mul|/work/spmd_rfdetr/model/masks.py:120", "criterion: masks"),
    ("clip/aten__norm|/x/torch/nn/utils/clip_grad.py:40", "gradient clipping"),
    ("aten__lerp|/work/spmd_rfdetr/training/ema.py:50", "EMA"),
    ("aten__where|/work/spmd_rfdetr/training/step.py:248", "non-finite guard"),
    ("aten__mul|/work/spmd_rfdetr/training/optim.py:70", "LR schedule"),
    ("aten__topk|/x/rfdetr/models/postprocess.py:138", "eval post-processing"),
    ("aten__native_batch_norm_backward|", "backward (unattributed)"),
    ("aten__mul|/x/somewhere_else.py:1", "other"),
    ("|", "other (no metadata)"),
])
def test_attribution_rules(key: str, component: str) -> None:
    from spmd_rfdetr.aot.components import attribute

    assert attribute(key) == component
