"""Start-up hook, run by ``ckptfmt_zarr_dtypes.pth``: teach zarr-python ckptfmt's data types.

zarr-python 3.1 never loads its ``zarr.data_type`` entry points (see ``ckptfmt/zarr_plugin.py``).
This hook waits, at no cost, until some program imports ``zarr.core.dtype``, then registers
``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2`` so that plain ``zarr.open_array`` reads
ckptfmt checkpoints without the program importing ckptfmt. It imports nothing heavy at start-up
and never lets a failure of its own break zarr's import.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType

_TARGET = "zarr.core.dtype"


class _ZarrDtypeFinder(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            try:
                from ckptfmt.zarr_plugin import register

                register()
            except Exception:
                pass

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    if (
        not any(isinstance(f, _ZarrDtypeFinder) for f in sys.meta_path)
        and _TARGET not in sys.modules
    ):
        sys.meta_path.insert(0, _ZarrDtypeFinder())


install()
