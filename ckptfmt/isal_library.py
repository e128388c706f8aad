"""Finding and loading Intel's ISA-L, the C library that the optional extra ``ckptfmt[fast]``
brings (``pyeclib``'s wheel bundles it as ``pyeclib.libs/libisal-pyeclib.so.2``).

ckptfmt builds no C. Two places call ISA-L through ``ctypes`` when it is there, each keeping
numpy or the ``crc32c`` package as the fallback: the Reed-Solomon kernels and the incremental
save's CRC-64 (``redundancy/isal.py``), and CRC32C (``checksum.py``: ``crc32_iscsi``, carry-less
multiply folding, about 30 GB/s on one core here against about 17 for the ``crc32c`` package).
This module only finds the file and opens it once for both; what each caller binds and checks
is its own. Neither pyeclib nor its C module is imported.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import threading
from pathlib import Path

LIBRARY_NAME = "libisal-pyeclib.so.2"


def find_library() -> str | None:
    """Path of the ISA-L library bundled with the installed ``pyeclib``, or None.

    Looks at the installed distribution's file list first, then beside the package that
    ``importlib.util.find_spec("pyeclib")`` locates (neither imports pyeclib).
    """
    try:
        dist = importlib.metadata.distribution("pyeclib")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name == LIBRARY_NAME:
                p = Path(str(dist.locate_file(f)))
                if p.is_file():
                    return str(p)
    try:
        spec = importlib.util.find_spec("pyeclib")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for pkg in spec.submodule_search_locations:
        libs = Path(pkg).parent / "pyeclib.libs"
        if (libs / LIBRARY_NAME).is_file():
            return str(libs / LIBRARY_NAME)
        found = sorted(libs.glob("libisal*.so*")) if libs.is_dir() else []
        if found:
            return str(found[0])
    return None


_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str | None, str | None] | None = None


def load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """The library opened once per process: ``(library, path, None)``, or ``(None, path or
    None, why)`` when it is not installed or does not load. Thread-safe; the first call looks
    for it (a few milliseconds), later ones return what it found."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = find_library()
            if path is None:
                _loaded = (None, None, "pyeclib (which bundles ISA-L) is not installed")
            else:
                try:
                    _loaded = (ctypes.CDLL(path), path, None)
                except OSError as e:
                    _loaded = (None, path, f"cannot load {path}: {e}")
        return _loaded


__all__ = ["LIBRARY_NAME", "find_library", "load"]
