"""Hard limits of format versions 1 to 3 (``spec/FORMAT.md``, "Limits") and the name rules.

A writer refuses to exceed them; a reader refuses a checkpoint that does, before allocating or
opening anything, so that a hostile manifest cannot make it read outside the checkpoint, allocate
without bound or recurse without bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptfmt.errors import InvalidNameError

FORMAT_VERSION = 2  # what ckptfmt writes unless an entry needs a later version
SUPPORTED_VERSIONS = (1, 2, 3)  # what it reads
CHECKSUM_SINCE = 2  # the first version whose manifest carries its own CRC32C (FORMAT.md §10)
CONTAINERS_SINCE = 3  # the first with list/tuple groups and encoded tensors (FORMAT.md §11)

MANIFEST_MAX_BYTES = 256 * 1024 * 1024
MAX_ENTRIES = 1_000_000
MAX_NAME_DEPTH = 64
MAX_COMPONENT_BYTES = 255
MAX_PATH_BYTES = 4096
MAX_NDIM = 32
MAX_DIM = 2**53  # JSON numbers are exact up to here in every common reader
MAX_TENSOR_BYTES = 2**50
MAX_CHUNK_BYTES = 2**30  # one inner chunk is read into memory whole
MAX_CHUNKS_PER_SHARD = 2**16  # the shard index is 16 bytes per slot
MAX_WORLD_SIZE = 1 << 20
MAX_JSON_DEPTH = 64

# Names a component may not take: zarr's and ckptfmt's own metadata documents and chunk folder
# names would collide with it on disk, "." and ".." would leave the node's folder.
RESERVED_COMPONENTS = frozenset(
    {"zarr.json", "ckptfmt.json", ".zattrs", ".zgroup", ".zarray", "ckptfmt-redundancy"}
)


# components found valid, kept so that a training loop saving the same names at every step
# checks each once (a few microseconds a name, on the training thread); bounded
_VALID: set[str] = set()
_VALID_MAX = 1 << 16


def check_component(component: object, full: Sequence[object] = ()) -> str:
    """Check one name component; return it. Raises :class:`InvalidNameError`."""
    if type(component) is str and component in _VALID:
        return component
    shown = "/".join(str(c) for c in full) if full else component
    if not isinstance(component, str):
        raise InvalidNameError(shown, f"component {component!r} is not a string")
    if component == "":
        raise InvalidNameError(shown, "empty component")
    if set(component) <= {"."}:
        raise InvalidNameError(shown, f"component {component!r} consists only of periods")
    if component.startswith("__"):
        raise InvalidNameError(shown, "components starting with '__' are reserved by zarr v3")
    if component in RESERVED_COMPONENTS:
        raise InvalidNameError(shown, f"component {component!r} is reserved")
    if "/" in component or "\\" in component:
        raise InvalidNameError(shown, "components may not contain '/' or '\\'")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in component):
        raise InvalidNameError(shown, "control characters (NUL included) are not allowed")
    try:
        encoded = component.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(shown, "not valid UTF-8 (lone surrogate)") from None
    if len(encoded) > MAX_COMPONENT_BYTES:
        raise InvalidNameError(shown, f"component longer than {MAX_COMPONENT_BYTES} bytes")
    if len(_VALID) < _VALID_MAX:
        _VALID.add(component)
    return component


def check_name(name: Sequence[object]) -> tuple[str, ...]:
    """Check a whole name (a sequence of components); return it as a tuple of strings."""
    if isinstance(name, str) or not isinstance(name, Sequence):
        raise InvalidNameError(name, "a name is a list of components")
    if not 1 <= len(name) <= MAX_NAME_DEPTH:
        raise InvalidNameError(name, f"a name has 1 to {MAX_NAME_DEPTH} components")
    out = tuple(check_component(c, name) for c in name)
    if len("/".join(out).encode("utf-8")) > MAX_PATH_BYTES:
        raise InvalidNameError("/".join(out), f"longer than {MAX_PATH_BYTES} bytes")
    return out


def display(name: Sequence[str]) -> str:
    """A name as users see it: components joined by '/'."""
    return "/".join(name)
