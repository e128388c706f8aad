"""Tensor names between ckptfmt and the flat, dotted names of PyTorch / Hugging Face files.

A ckptfmt name is a tuple of components, shown joined by ``/`` (``model/layers.0.weight``: a
``ckptfmt_torch`` checkpoint keeps each ``state_dict()`` key as one component under ``model``).
Exporting strips a prefix (``model/`` by default) and turns the remaining ``/`` into ``.``, so the
names are those of ``model.state_dict()``; importing puts the foreign names under a prefix
(``model`` by default) and splits them at ``/`` (dots stay inside a component), so
``ckptfmt_torch.load({"model": model}, path)`` finds them. ``--rename OLD=NEW`` rules rewrite a
leading ``OLD`` of the foreign-side name into ``NEW`` (the first rule that matches wins): after
the default mapping on export, before it on import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptfmt.errors import InvalidNameError, UsageError
from ckptfmt.manifest.limits import check_name


@dataclass(frozen=True)
class Rename:
    """One ``OLD=NEW`` rule: a name starting with ``old`` has that start replaced by ``new``."""

    old: str
    new: str

    @classmethod
    def parse(cls, text: str) -> Rename:
        old, sep, new = text.partition("=")
        if not sep or not old:
            raise UsageError(f"a rename is OLD=NEW with a non-empty OLD, got {text!r}")
        return cls(old, new)


def renames_of(rules: Iterable[str | Rename | tuple[str, str]]) -> list[Rename]:
    """Rules given as ``"OLD=NEW"`` strings, ``(old, new)`` pairs or :class:`Rename`."""
    out = []
    for r in rules:
        if isinstance(r, Rename):
            out.append(r)
        elif isinstance(r, str):
            out.append(Rename.parse(r))
        else:
            old, new = r
            if not old:
                raise UsageError("a rename needs a non-empty OLD")
            out.append(Rename(str(old), str(new)))
    return out


def apply_renames(name: str, rules: Sequence[Rename]) -> str:
    for r in rules:
        if name.startswith(r.old):
            return r.new + name[len(r.old) :]
    return name


def export_name(name: str, strip: str, rules: Sequence[Rename]) -> str:
    """The foreign name of the ckptfmt tensor ``name`` ('/'-joined)."""
    if strip and name.startswith(strip):
        name = name[len(strip) :]
    return apply_renames(name.replace("/", "."), rules)


def import_name(name: str, prefix: str, rules: Sequence[Rename]) -> tuple[str, ...]:
    """The ckptfmt name of the foreign tensor ``name``; :class:`InvalidNameError` when it breaks
    ckptfmt's name rules (``..``, empty components, ``__`` prefixes, control characters)."""
    renamed = apply_renames(name, rules)
    parts = ([*prefix.strip("/").split("/")] if prefix.strip("/") else []) + renamed.split("/")
    return check_name(parts)


def unique(pairs: Iterable[tuple[str, str]], what: str) -> None:
    """Raise :class:`UsageError` when two source names map to the same target name."""
    seen: dict[str, str] = {}
    for src, dst in pairs:
        if dst in seen:
            raise UsageError(f"{what}: {seen[dst]!r} and {src!r} both become {dst!r}")
        seen[dst] = src


__all__ = [
    "InvalidNameError",
    "Rename",
    "apply_renames",
    "export_name",
    "import_name",
    "renames_of",
    "unique",
]
