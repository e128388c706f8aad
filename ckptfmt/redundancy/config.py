"""What redundancy a save gets: one :class:`Redundancy` (scheme, parity count, set size), and a
:class:`Policy` choosing one per save by cadence, the way SCR's checkpoint descriptors do
(``spec/redundancy.md``, "Policy")::

    Policy.of([{"every": 1, "redundancy": "xor"},
               {"every": 10, "redundancy": "rs", "m": 2},
               {"every": 100, "flush": True}])

Save number ``n`` (1, 2, ... counted by the manager) takes the redundancy of the matching
descriptor (``n % every == 0``) with the largest ``every`` that names one, and is also flushed to
level 3 when any matching descriptor says ``flush``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfmt.errors import UsageError
from ckptfmt.redundancy.schemes import SCHEMES, RedundancyScheme

DEFAULT_SET_SIZE = 8


@dataclass(frozen=True)
class Redundancy:
    """One scheme applied over redundancy sets of up to ``set_size`` ranks on distinct nodes.

    ``m`` is the number of parity chunks per stripe: 1 for ``xor``, >= 1 for ``rs`` (default 2),
    unused (0) for ``partner``.
    """

    scheme: str
    m: int = 0
    set_size: int = DEFAULT_SET_SIZE

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise UsageError(
                f"unknown redundancy scheme {self.scheme!r} (known: {sorted(SCHEMES)})"
            )
        cls = SCHEMES[self.scheme]
        if not isinstance(self.m, int) or isinstance(self.m, bool):
            raise UsageError(f"m must be an integer, got {self.m!r}")
        m = cls.resolve_m(self.m)
        object.__setattr__(self, "m", m)
        object.__setattr__(self, "_code", cls.with_m(m))
        if not isinstance(self.set_size, int) or not self.min_size <= self.set_size <= 256:
            varies = cls.M_RANGE[0] != cls.M_RANGE[1]
            raise UsageError(
                f"set_size must be between {self.min_size} and 256 for {self.scheme}"
                f"{f' with m={m}' if varies else ''}, got {self.set_size!r}"
            )

    @property
    def code(self) -> RedundancyScheme:
        """The scheme object: the one owner of this scheme's geometry and plans."""
        code: RedundancyScheme = object.__getattribute__(self, "_code")
        return code

    @property
    def min_size(self) -> int:
        """The fewest members a set may have (two for partner and xor, m + 1 for rs)."""
        return self.code.min_members()

    def make_scheme(self) -> RedundancyScheme:
        return self.code

    @classmethod
    def of(cls, spec: str | Redundancy | Mapping[str, Any]) -> Redundancy:
        """From a scheme id (``"xor"``), a mapping (``{"scheme": "rs", "m": 2}``) or itself."""
        if isinstance(spec, Redundancy):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"scheme", "m", "set_size"}
            if unknown:
                raise UsageError(f"unknown redundancy options {sorted(unknown)}")
            return cls(
                str(spec.get("scheme")),
                int(spec.get("m", 0)),
                int(spec.get("set_size", DEFAULT_SET_SIZE)),
            )
        raise UsageError(f"a redundancy is a scheme name or a mapping, got {spec!r}")

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "m": self.m, "set_size": self.set_size}


@dataclass(frozen=True)
class Descriptor:
    """Every ``every``-th save gets ``redundancy`` (None: this descriptor names none) and, with
    ``flush``, a copy on level 3."""

    every: int = 1
    redundancy: Redundancy | None = None
    flush: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise UsageError(f"a descriptor's 'every' must be an int >= 1, got {self.every!r}")


@dataclass(frozen=True)
class Policy:
    """Descriptors, applied by cadence (module docstring)."""

    descriptors: tuple[Descriptor, ...] = ()

    @classmethod
    def of(
        cls,
        spec: str
        | Path
        | Redundancy
        | Policy
        | Mapping[str, Any]
        | Sequence[Mapping[str, Any] | Descriptor]
        | None,
    ) -> Policy:
        """From None (no redundancy), one redundancy for every save (a scheme id, a
        :class:`Redundancy`, a mapping such as ``{"scheme": "rs", "m": 2}``), a list of
        descriptor mappings, or a JSON file's path (``*.json``: a list of descriptor mappings)."""
        if spec is None:
            return cls()
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, Path) or (isinstance(spec, str) and spec.endswith(".json")):
            try:
                doc = json.loads(Path(spec).read_text())
            except (OSError, ValueError) as exc:
                raise UsageError(f"cannot read the redundancy policy {spec}: {exc}") from None
            return cls.of(doc)
        if isinstance(spec, (str, Redundancy, Mapping)):  # one redundancy for every save
            return cls((Descriptor(1, Redundancy.of(spec)),))
        if not isinstance(spec, Sequence):
            raise UsageError(f"a policy is a list of descriptors, got {spec!r}")
        out = []
        for d in spec:
            if isinstance(d, Descriptor):
                out.append(d)
                continue
            if not isinstance(d, Mapping):
                raise UsageError(f"a descriptor is a mapping, got {d!r}")
            unknown = set(d) - {"every", "redundancy", "m", "set_size", "flush"}
            if unknown:
                raise UsageError(f"unknown descriptor options {sorted(unknown)}")
            red = None
            if d.get("redundancy") is not None:
                red = Redundancy.of(
                    {
                        "scheme": d["redundancy"],
                        "m": d.get("m", 0),
                        "set_size": d.get("set_size", DEFAULT_SET_SIZE),
                    }
                )
            out.append(Descriptor(d.get("every", 1), red, bool(d.get("flush", False))))
        return cls(tuple(out))

    def redundancy_for(self, n: int) -> Redundancy | None:
        """The redundancy of save number ``n`` (1-based)."""
        best: Descriptor | None = None
        for d in self.descriptors:
            usable = d.redundancy is not None and n % d.every == 0
            if usable and (best is None or d.every > best.every):
                best = d
        return None if best is None else best.redundancy

    def flush_for(self, n: int) -> bool:
        """Whether a descriptor asks for save number ``n`` to be flushed to level 3."""
        return any(d.flush and n % d.every == 0 for d in self.descriptors)

    def all_redundancies(self) -> list[Redundancy]:
        return [d.redundancy for d in self.descriptors if d.redundancy is not None]
