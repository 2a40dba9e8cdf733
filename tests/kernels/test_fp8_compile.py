"""The FP8 kernels compiled for sm_90 on any machine (in a child process without TRITON_INTERPRET): every
GEMM multiplies on FP8 wgmma with the operand formats its recipe names, both operands reach shared memory
through asynchronous copies into multi-buffered tiles (none through registers), the tensorwise products
leave wgmma groups in flight; the quantization kernels convert with cvt.rn.satfinite and divide with
div.rn (codes bit-exact, no flushed denormals)."""

from __future__ import annotations

import json
import re

import pytest

from ._compile import compile_sm90, in_child

_TRITON_TYPES = {
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
    "bfloat16": "bf16",
    "float32": "fp32",
    "int32": "i32",
}
# (gemm, recipe) -> the wgmma operand formats
_WGMMA = {
    ("forward", "tensorwise"): "e4m3.e4m3",
    ("dgrad", "tensorwise"): "e5m2.e4m3",
    ("wgrad", "tensorwise"): "e4m3.e5m2",
    ("forward", "blockwise"): "e4m3.e4m3",
    ("dgrad", "blockwise"): "e4m3.e4m3",
    ("wgrad", "blockwise"): "e4m3.e4m3",
}
_WGMMA_FORMATS = r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.(\w+\.\w+)"
_WAITS = r"warp_group_dot_wait[^\n]*pendings = (\d+)"
# A layer's gate/up projection: M rows in E groups, K x N weights.
_ROWS, _GROUPS, _DEPTH, _COLS = 32768, 8, 4096, 14336


def _pointers(plan, launch, inputs: dict[str, str]) -> dict[str, str]:
    """Triton pointer types of a launch's arguments: inputs as given, outputs from the plan's buffers."""
    pointers = {}
    for index, arg in enumerate((*launch.args, *launch.outputs)):
        if isinstance(arg, str):
            dtype = inputs.get(arg) or plan.buffers[arg].dtype
            pointers[launch.kernel.arg_names[index]] = "*" + _TRITON_TYPES[dtype]
    return pointers


def _gemm_records() -> list[dict]:
    from moetriton import kernels
    from moetriton.kernels.rules.fp8 import RECIPES

    records = []
    sizes = dict(num_rows=_ROWS, num_groups=_GROUPS)
    for recipe, spec in RECIPES.items():
        fwd, grad = spec.forward_dtype, spec.gradient_dtype
        variants = [
            ("forward", kernels.fp8_grouped_matmul_plan(recipe=recipe, depth=_DEPTH, num_cols=_COLS, **sizes),
             dict(lhs=fwd, rhs=fwd)),
            ("dgrad", kernels.fp8_grouped_matmul_plan(
                recipe=recipe, depth=_COLS, num_cols=_DEPTH, data_gradient=True, **sizes),
             dict(lhs=grad, rhs=fwd)),
            ("wgrad", kernels.fp8_grouped_matmul_wgrad_plan(
                recipe=recipe, depth=_DEPTH, num_cols=_COLS, **sizes),
             dict(lhs=fwd, grad=grad)),
        ]  # fmt: skip
        for gemm, plan, operands in variants:
            inputs = dict(operands, lhs_scale="float32", rhs_scale="float32", grad_scale="float32")
            (launch,) = plan.launches
            inputs["group_sizes"] = "int32"
            compiled = compile_sm90(
                launch.kernel, launch.constexprs, _pointers(plan, launch, inputs),
                num_warps=launch.num_warps, num_stages=launch.num_stages,
            )  # fmt: skip
            ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
            start = ttgir.find("scf.for")
            loop = ttgir[start : ttgir.find("scf.yield", start)]
            records.append(
                dict(
                    gemm=gemm,
                    recipe=recipe,
                    stages=launch.num_stages,
                    wgmma=sorted(
                        set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.(\w+\.\w+)", ptx))
                    ),
                    mma_sync=len(re.findall(r"mma\.sync", ptx)),
                    async_fp8_copies=len(re.findall(r"async_copy_global_to_local[^\n]*f8E", ttgir)),
                    fp8_buffers=re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+xf8", ttgir),
                    register_fp8_stores=len(re.findall(r"local_alloc %[^\n]*f8E", loop)),
                    wait_pendings=[
                        int(n) for n in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", loop)
                    ],
                )
            )
    return records


def _quantize_records() -> list[dict]:
    from moetriton import kernels
    from moetriton.kernels.rules.fp8 import FP8_MAX, RECIPES

    records = []
    for recipe in RECIPES:
        for fp8 in FP8_MAX:
            common = dict(recipe=recipe, element_bytes=2, fp8_dtype=fp8)
            plans = [
                kernels.quantize_plan(
                    num_rows=_ROWS, width=_DEPTH, num_groups=_GROUPS, columnwise=True, **common
                ),
                kernels.quantize_weights_plan(num_groups=_GROUPS, depth=_DEPTH, num_cols=_COLS, **common),
            ]
            for plan in plans:
                for launch in plan.launches:
                    inputs = dict(inp="bfloat16", weight="bfloat16", group_sizes="int32")
                    compiled = compile_sm90(
                        launch.kernel, launch.constexprs, _pointers(plan, launch, inputs),
                        num_warps=launch.num_warps, num_stages=1,
                    )  # fmt: skip
                    ptx = compiled.asm["ptx"]
                    records.append(
                        dict(
                            kernel=launch.kernel.__name__,
                            fp8=fp8,
                            conversions=sorted(set(re.findall(r"cvt\.rn\.satfinite\.\w+\.f32", ptx))),
                            divisions=sorted(set(re.findall(r"div\.\w+(?:\.\w+)?\.f32", ptx))),
                        )
                    )
    return records


def _compile_all() -> None:
    """Child process: print every record as JSON."""
    print(json.dumps(dict(gemm=_gemm_records(), quantize=_quantize_records())))


@pytest.fixture(scope="module")
def report() -> dict:
    return in_child("tests.kernels.test_fp8_compile:_compile_all")


def test_every_gemm_runs_on_fp8_wgmma_with_pipelined_k_major_operands(report):
    assert len(report["gemm"]) == len(_WGMMA)
    for record in report["gemm"]:
        assert record["wgmma"] == [_WGMMA[record["gemm"], record["recipe"]]], record
        assert record["mma_sync"] == 0, record
        assert record["register_fp8_stores"] == 0, record
        assert record["fp8_buffers"] == [str(record["stages"])] * 2, record
        assert record["async_fp8_copies"] >= 2 * (record["stages"] - 1), record
        if record["recipe"] == "tensorwise":  # scaled once at the end: the wgmma chain stays asynchronous
            assert record["wait_pendings"] and min(record["wait_pendings"]) >= 1, record


def test_quantization_converts_in_hardware_and_divides_exactly(report):
    kinds = {record["kernel"] for record in report["quantize"]}
    assert kinds == {"_amax_kernel", "_quantize_kernel", "_quantize_weights_kernel"}
    for record in report["quantize"]:
        if record["kernel"] == "_amax_kernel":
            assert not record["conversions"] and not record["divisions"], record
            continue
        fmt = "e5m2" if record["fp8"] == "float8_e5m2" else "e4m3"
        assert record["conversions"] == [f"cvt.rn.satfinite.{fmt}x2.f32"], record
        assert record["divisions"] == ["div.rn.f32"], record
