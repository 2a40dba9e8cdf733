"""Every Python code block of README.md and docs/*.md runs as written, on CPU.

Each block runs in a fresh interpreter from the repository root, with no GPU visible, 8 host CPU devices for
JAX (`--xla_force_host_platform_device_count=8`, for the mesh examples) and without TRITON_INTERPRET, so the
ops run their pure-framework references: the kernels are tested by the rest of the suite, and what counts
here is that the code as written runs (names, arguments, shapes). A block that sets TRITON_INTERPRET itself
(the FP8 ops have no reference) skips where the interpreter cannot run the kernels (Triton 3.6 with NumPy
2.4 or later, as on a GPU machine's image). An HTML comment on the line before a
block changes how it runs:

    <!-- docs-test: continue -->     run after the blocks before it in the same file, in one process
    <!-- docs-test: torchrun N -->   run under torchrun with N processes (gloo on CPU)
    <!-- docs-test: skip REASON -->  not run; reported as a skipped test with REASON

No block is left out silently: every ```python block of those files is one test case here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .strategies_router import skip_unless_interpreter_runs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(continue|torchrun\s+(\d+)|skip\s*(.*?))\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


@dataclass
class Block:
    path: Path
    line: int
    code: str  # with every block it continues
    torchrun: int = 0
    skip: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found: list[Block] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        code = match.group(1)
        block = Block(path, line, code)
        if marker and marker.group(1) == "continue":
            if not found:
                raise AssertionError(f"{block.name}: 'continue' with no block before it")
            block.code = found[-1].code + "\n" + code
            block.torchrun = found[-1].torchrun
        elif marker and marker.group(2):
            block.torchrun = int(marker.group(2))
        elif marker:
            block.skip = marker.group(3) or "no reason given"
        found.append(block)
    return found


ALL = [block for path in DOCS for block in blocks(path)]


def test_every_doc_file_is_read():
    assert (ROOT / "docs" / "design.md") in DOCS and len(ALL) >= 8, [block.name for block in ALL]


@pytest.mark.parametrize("block", ALL, ids=[block.name for block in ALL])
def test_code_block_runs(block: Block, tmp_path: Path):
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    if "TRITON_INTERPRET" in block.code:
        skip_unless_interpreter_runs(block.name)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        OMP_NUM_THREADS="1",
    )
    if block.torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(block.torchrun), str(script)]
    else:
        command = [sys.executable, str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
