"""`vserve.workers` and `vserve.csrc_triton` from a source checkout that is not installed.

The two folders sit beside `vserve/` and install inside its namespace (pyproject's
`package-dir`). An installed vserve finds them by the installer's mapping; a checkout used
straight from its folder (`PYTHONPATH=<checkout>`, or a script run from the checkout's root,
as the GPU check does) needs this finder, which maps them to the checkout's own folders, so a
second checkout never borrows the installed one's workers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

FOLDERS = {"vserve.workers": "workers", "vserve.csrc_triton": "csrc_triton"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = FOLDERS.get(fullname)
        if folder is None:
            return None
        package = self.root / folder
        return importlib.util.spec_from_file_location(
            fullname, package / "__init__.py", submodule_search_locations=[str(package)]
        )


def install() -> None:
    """Put the finder first when this vserve is a checkout's `vserve/` folder (its root has
    pyproject.toml and the two folders); an installed wheel has `vserve/workers` itself."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or not all(
        (root / f / "__init__.py").is_file() for f in FOLDERS.values()
    ):
        return
    if not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceTreeFinder(root))


install()
