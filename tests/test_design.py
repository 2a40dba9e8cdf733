"""docs/design.md's map of the package ("Layers" and "Reading the code") against the tree: every file it
names exists, and every module of the package is named in "Reading the code", so the map cannot drift
from the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("moetriton", "kernels", "torch_bindings", "jax_bindings")


def _section(title: str) -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _named_paths(section: str) -> set[Path]:
    """Paths in the first column of a table's rows: a path with a folder, then names in the same folder
    (`kernels/grouped_gemm.py`, `activation.py`), and brace lists (`torch_bindings/{api,ops}.py`)."""
    paths: set[Path] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder = None
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0].strip("| ")):
            if "{" in token:
                head, names, tail = re.match(r"(.*)\{(.*)\}(.*)", token).groups()
                paths.update(ROOT / f"{head}{name}{tail}" for name in names.split(","))
                continue
            if "/" in token.rstrip("/"):
                folder = (ROOT / token).parent
                paths.add(ROOT / token)
            elif folder is not None:
                paths.add(folder / token)
            else:
                paths.add(ROOT / token)
    return paths


def test_every_file_the_map_names_exists():
    for title in ("Layers", "Reading the code"):
        for path in _named_paths(_section(title)):
            assert path.exists(), f"docs/design.md, {title!r}: {path.relative_to(ROOT)} does not exist"


def test_every_module_of_the_package_is_on_the_map():
    named = _named_paths(_section("Reading the code"))
    for folder in PACKAGE_FOLDERS:
        for module in sorted((ROOT / folder).rglob("*.py")):
            if module.name == "__init__.py" and module.parent not in (ROOT / "kernels", ROOT / "moetriton"):
                continue
            assert module in named, (
                f"docs/design.md, 'Reading the code' does not name {module.relative_to(ROOT)}"
            )
