"""Compiling kernels for an H100 (sm_90) on any machine: Triton lowers to TTGIR without a GPU, so the CPU
suite sees compile errors and code-generation choices that the interpreter hides. Kernels are compiled in a
child process without TRITON_INTERPRET (interpreted, a kernel is not a compilable function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_sm90(kernel, constexprs: dict, pointers: dict[str, str], num_warps: int = 4, num_stages: int = 3):
    """`kernel` compiled for sm_90: arguments named in `constexprs` fixed, those in `pointers` pointers of
    the given Triton type ("*bf16", "*i32", ...), 16-byte aligned, every other argument an i32 scalar."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "i32")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in pointers}
    return triton.compile(
        ASTSource(kernel, signature, constexprs, aligned),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )


def in_child(call: str) -> object:
    """The JSON that `call` (a Python expression run from the repository root, e.g.
    "tests.kernels.test_x:_compile_all", module:function) prints last, run in a child process without
    TRITON_INTERPRET; skips where this Triton cannot target sm_90."""
    module, function = call.split(":")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", f"from {module} import {function}; {function}()"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode != 0:
        if "GPUTarget" in child.stderr or "backend" in child.stderr.lower():
            pytest.skip(f"cannot compile for sm_90 here: {child.stderr.strip().splitlines()[-1]}"[:200])
        raise AssertionError(child.stderr[-3000:])
    return json.loads(child.stdout.strip().splitlines()[-1])
