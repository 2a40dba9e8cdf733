"""Package discovery for setuptools (everything else is in pyproject.toml).

pyproject.toml's package-dir maps each of moetriton's import names to a source folder; every package below
those folders (a folder with an __init__.py) ships under its import name, so a module or subpackage added
later is in the wheel without a list to update.
"""

import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def packages() -> list[str]:
    """Import names of every package under the mapped folders, e.g. moetriton.torch.moe for
    torch_bindings/moe."""
    found = set()
    for name, folder in PACKAGE_DIR.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    return sorted(found)


setup(packages=packages())
