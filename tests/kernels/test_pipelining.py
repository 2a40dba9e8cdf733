"""The grouped-GEMM product kernel pipelines its loads the same with and without row permutations.

Compiled for an H100 (sm_90) on any machine: Triton lowers to TTGIR without a GPU, so the CPU suite sees
what the interpreter hides. A permutation read inside a kernel's pipelined loop makes Triton's pipeliner
give it stages of its own, and at the config's stage count wait for every copy in flight at each step (no
overlap of loads and products; seen in a permuted weight gradient, 25-35% slower on H200s). The product
kernel reads its permutation once per tile, before its K loop: the check compares the software pipeline
of every permuted variant with the plain one's (shared-memory buffers of the two tiles, copies each wait
in the loop leaves in flight). The kernel is compiled in a child process without TRITON_INTERPRET
(interpreted, it is not a compilable function).
"""

from __future__ import annotations

import json
import re

import pytest

from ._compile import compile_sm90, in_child

_POINTERS = {"lhs_ptr": "*bf16", "rhs_ptr": "*bf16", "out_ptr": "*bf16"}
_POINTERS.update(group_sizes_ptr="*i32", lhs_rows_ptr="*i32", out_rows_ptr="*i32")
_PRODUCT = dict(
    NUM_GROUPS=8, GROUPS_POW2=8, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, SWIZZLE=8, FP32_DOT=False,
    NUM_COLS=4096, DEPTH=7168, RHS_K_STRIDE=4096, RHS_N_STRIDE=1, ZERO_TAIL=True,
)  # fmt: skip
_PAIRS = [(False, False), (True, False), (False, True), (True, True)]


def _pipeline(kernel, constexprs: dict, num_stages: int) -> list[list[int]]:
    """[buffers of each bf16 tile in shared memory, copies left in flight by each wait inside the loop] in
    the TTGIR of `kernel` compiled for sm_90."""
    ttgir = compile_sm90(kernel, constexprs, _POINTERS, num_warps=8, num_stages=num_stages).asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for") : ttgir.index("scf.yield")]
    return [
        [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+xbf16", ttgir)],
        [int(n) for n in re.findall(r"async_wait[^\n]*num = (\d+)", loop)],
    ]


def _compile_all() -> None:
    """Child process: print the pipeline of every variant as JSON."""
    from moetriton.kernels import grouped_gemm

    results = [
        _pipeline(grouped_gemm._grouped_matmul_kernel, dict(_PRODUCT, GATHER_LHS=g, SCATTER_OUT=s), 3)
        for g, s in _PAIRS
    ]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def pipelines() -> dict:
    results = in_child("tests.kernels.test_pipelining:_compile_all")
    return dict(zip(_PAIRS, results, strict=True))


@pytest.mark.parametrize("permuted", _PAIRS[1:], ids=["lhs", "out", "both"])
def test_permuted_product_pipelines_like_the_plain_one(pipelines, permuted):
    plain = pipelines[(False, False)]
    assert plain[0] == [3, 3] and plain[1] and min(plain[1]) >= 1, plain  # both tiles 3 deep, overlapped
    assert pipelines[permuted] == plain
