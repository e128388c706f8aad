"""Redundancy schemes, and a registry from the on-disk id to the class (``spec/redundancy.md``).

Each scheme object is the one owner of what differs between schemes, at two levels:

- *blocks*: ``k`` data blocks of one length (indices ``0..k-1``) and the ``n_parity(k)`` blocks
  derived from them (``encode``, ``rebuild``, ``tolerates``);
- *a redundancy set* of ``n`` members on distinct nodes (§4, "Placement"): how many parity
  chunks a stripe has (``m``), the chunk size and every member's data and parity buffer sizes
  from the members' data sizes, the CRCs per parity file, the ``code`` the record names, how
  many members a set needs, the valid ``m``, and the encode and rebuild plans
  (:mod:`ckptfmt.redundancy.stripes`) the engine runs.

Nothing outside this module branches on a scheme's name.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from ckptfmt.errors import UnrecoverableError as UnrecoverableError  # re-exported
from ckptfmt.errors import UsageError
from ckptfmt.redundancy import gf256
from ckptfmt.redundancy.stripes import Op, plan_copies, plan_stripes

POLYNOMIAL = 0x11D  # GF(2^8) reduction polynomial x^8 + x^4 + x^3 + x^2 + 1 (gf256's tables)


class RedundancyScheme(abc.ABC):
    """One way to protect ``k`` equal-length uint8 blocks. Subclasses set :attr:`name`."""

    name: ClassVar[str]  # the id written to disk

    @abc.abstractmethod
    def tolerates(self, k: int) -> int:
        """How many blocks (of the k + n_parity(k)) may be lost, in any combination."""

    @abc.abstractmethod
    def n_parity(self, k: int) -> int:
        """How many blocks :meth:`encode` derives from k data blocks."""

    @abc.abstractmethod
    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The parity (or copy) blocks of ``data``: k 1-D uint8 arrays of one length."""

    @abc.abstractmethod
    def rebuild(
        self, k: int, blocks: Mapping[int, np.ndarray], lost: Sequence[int]
    ) -> dict[int, np.ndarray]:
        """Rebuild the blocks ``lost`` from the surviving ``blocks`` (index -> array).

        Returns index -> rebuilt array for each index in ``lost``; raises
        :class:`UnrecoverableError` when that is impossible.
        """

    # --- a redundancy set of n members (spec/redundancy.md §4) ---

    copies_whole: ClassVar[bool] = False  # a member's parity is a whole copy of another's data
    M_RANGE: ClassVar[tuple[int, int]]  # the valid parity chunks per stripe, as recorded

    @property
    @abc.abstractmethod
    def m(self) -> int:
        """Parity chunks per stripe (0: the parity is a whole copy)."""

    @classmethod
    def resolve_m(cls, m: int) -> int:
        """The ``m`` a configuration asking for ``m`` (0: the default) gets; a clear error when
        the scheme takes no such ``m``."""
        lo, hi = cls.M_RANGE
        if m == 0 and lo > 0:
            return max(lo, 2) if hi > lo else lo
        if not lo <= m <= hi:
            raise UsageError(cls._m_error(m))
        return m

    @classmethod
    def _m_error(cls, m: int) -> str:
        lo, hi = cls.M_RANGE
        return f"{cls.name} needs {lo} <= m <= {hi}, got m={m}"

    @classmethod
    def with_m(cls, m: int) -> RedundancyScheme:
        """The scheme object for a recorded or resolved ``m``."""
        cls.resolve_m(m)
        return cls()

    def min_members(self) -> int:
        """The fewest members a set may have."""
        return max(2, self.m + 1)

    def parity_chunks(self) -> int:
        """Chunks (and so CRCs) per parity file."""
        return max(self.m, 1)

    @abc.abstractmethod
    def set_chunk(self, sizes: Sequence[int]) -> int:
        """The chunk size S of a set whose members hold ``sizes`` bytes of data."""

    @abc.abstractmethod
    def data_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        """Member ``j``'s data buffer: its data, zero-padded to what the ops address."""

    @abc.abstractmethod
    def parity_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        """The size of member ``j``'s parity file."""

    @abc.abstractmethod
    def code_json(self) -> dict[str, object]:
        """The record's ``code``: which arithmetic the parity was computed with."""

    @abc.abstractmethod
    def rebuild_plan(
        self,
        n: int,
        data_lost: Collection[int],
        parity_lost: Collection[tuple[int, int]],
        via_tmp: bool = True,
    ) -> list[Op]:
        """The ops rebuilding the lost data of members ``data_lost`` (positions) and the lost
        parity chunks ``parity_lost`` (``(member, p)``) of a set of ``n``; raises
        :class:`UnrecoverableError` beyond the tolerance."""

    def encode_plan(self, n: int) -> list[Op]:
        """Encoding a set of ``n``: the rebuild of every parity chunk from intact data, each
        straight into its parity (every member local)."""
        lost = [(j, p) for j in range(n) for p in range(self.parity_chunks())]
        return self.rebuild_plan(n, (), lost, via_tmp=False)

    def _check(self, k: int, blocks: Mapping[int, np.ndarray], lost: Sequence[int]) -> int:
        total = k + self.n_parity(k)
        lost_set = set(lost)
        bad = [i for i in lost_set if not 0 <= i < total]
        if bad:
            raise UsageError(f"{self.name}: block indices {sorted(bad)} outside 0..{total - 1}")
        missing = lost_set | {i for i in range(total) if i not in blocks}
        if len(missing) > self.tolerates(k):
            raise UnrecoverableError(self.name, sorted(missing), self.tolerates(k), k)
        sizes = {blocks[i].size for i in range(total) if i not in missing}
        if len(sizes) > 1:
            raise UsageError(f"{self.name}: blocks of different lengths {sorted(sizes)}")
        return sizes.pop() if sizes else 0


def _blocks(data: Sequence[np.ndarray]) -> list[np.ndarray]:
    if not data:
        raise UsageError("encode needs at least one data block")
    out = [np.ascontiguousarray(d, np.uint8).reshape(-1) for d in data]
    if len({d.size for d in out}) > 1:
        raise UsageError(f"data blocks of different lengths {sorted({d.size for d in out})}")
    return out


def _xor_into(out: np.ndarray, inputs: Sequence[np.ndarray]) -> None:
    """``out = XOR of inputs``, one cache-sized slice at a time (no temporaries)."""
    n = out.size
    for start in range(0, n, gf256.SLICE):
        o = out[start : start + gf256.SLICE]
        o[:] = inputs[0][start : start + gf256.SLICE]
        for inp in inputs[1:]:
            np.bitwise_xor(o, inp[start : start + gf256.SLICE], out=o)


class Partner(RedundancyScheme):
    """A full copy of each member: block ``k + i`` is member i's data. The copy of member i is
    stored on member ``(i + 1) % k``'s node, so losing one node (data i and copy i-1) is
    rebuilt; as blocks, any single loss is."""

    name = "partner"
    copies_whole = True
    M_RANGE = (0, 0)

    @property
    def m(self) -> int:
        return 0

    @classmethod
    def _m_error(cls, m: int) -> str:
        return "partner takes no m"

    def set_chunk(self, sizes: Sequence[int]) -> int:
        return max(sizes)

    def data_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        return sizes[j]

    def parity_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        return sizes[(j - 1) % len(sizes)]  # the copy of the previous member's data

    def code_json(self) -> dict[str, object]:
        return {"matrix": "copy"}

    def rebuild_plan(
        self,
        n: int,
        data_lost: Collection[int],
        parity_lost: Collection[tuple[int, int]],
        via_tmp: bool = True,
    ) -> list[Op]:
        return plan_copies(self.name, n, data_lost, parity_lost)

    def tolerates(self, k: int) -> int:
        return 1

    def n_parity(self, k: int) -> int:
        return k

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [d.copy() for d in _blocks(data)]

    def rebuild(
        self, k: int, blocks: Mapping[int, np.ndarray], lost: Sequence[int]
    ) -> dict[int, np.ndarray]:
        if any(not 0 <= i < 2 * k for i in lost):
            raise UsageError(f"{self.name}: block indices {sorted(lost)} outside 0..{2 * k - 1}")
        missing = set(lost) | {i for i in range(2 * k) if i not in blocks}
        # beyond `tolerates`, a loss is rebuilt as long as each member keeps one of its two copies
        if any(i in missing and i + k in missing for i in range(k)):
            raise UnrecoverableError(self.name, sorted(missing), 1, k)
        return {i: blocks[(i + k) % (2 * k)].copy() for i in lost}


class _Striped(RedundancyScheme):
    """A set cut into stripes (``xor``, ``rs``): each member's data in ``n - m`` chunks of S bytes,
    stripe r a codeword of a systematic ``(c + m) x c`` generator, its parity chunks rotating
    over the members (:mod:`ckptfmt.redundancy.stripes`)."""

    @abc.abstractmethod
    def generator(self, c: int) -> np.ndarray:
        """The systematic ``(c + m) x c`` generator over GF(2^8) (read-only)."""

    def set_chunk(self, sizes: Sequence[int]) -> int:
        return -(-max(sizes) // (len(sizes) - self.m))

    def data_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        return (len(sizes) - self.m) * chunk

    def parity_bytes(self, sizes: Sequence[int], j: int, chunk: int) -> int:
        return self.m * chunk

    def rebuild_plan(
        self,
        n: int,
        data_lost: Collection[int],
        parity_lost: Collection[tuple[int, int]],
        via_tmp: bool = True,
    ) -> list[Op]:
        if n - self.m < 1:
            raise UsageError(f"a set of {n} cannot carry {self.m} parity chunks per stripe")
        g = self.generator(n - self.m)
        return plan_stripes(self.name, n, self.m, g, data_lost, parity_lost, via_tmp)


@lru_cache(maxsize=256)
def _xor_generator(c: int) -> np.ndarray:
    g = np.zeros((c + 1, c), np.uint8)
    g[:c] = np.eye(c, dtype=np.uint8)
    g[c] = 1
    g.setflags(write=False)
    return g


@lru_cache(maxsize=256)
def _cauchy_generator(c: int, m: int) -> np.ndarray:
    g = gf256.cauchy_matrix(c, m)
    g.setflags(write=False)
    return g


class Xor(_Striped):
    """One parity block, the XOR of the k members (RAID-5): any one loss is rebuilt."""

    name = "xor"
    M_RANGE = (1, 1)

    @property
    def m(self) -> int:
        return 1

    @classmethod
    def resolve_m(cls, m: int) -> int:
        if m not in (0, 1):
            raise UsageError("xor has exactly one parity (m=1)")
        return 1

    def generator(self, c: int) -> np.ndarray:
        return _xor_generator(c)

    def code_json(self) -> dict[str, object]:
        return {"matrix": "xor"}

    def tolerates(self, k: int) -> int:
        return 1

    def n_parity(self, k: int) -> int:
        return 1

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        blocks = _blocks(data)
        parity = np.empty(blocks[0].size, np.uint8)
        _xor_into(parity, blocks)
        return [parity]

    def rebuild(
        self, k: int, blocks: Mapping[int, np.ndarray], lost: Sequence[int]
    ) -> dict[int, np.ndarray]:
        n = self._check(k, blocks, lost)
        if not lost:
            return {}
        (i,) = set(lost)
        out = np.empty(n, np.uint8)
        _xor_into(out, [blocks[j] for j in range(k + 1) if j != i])
        return {i: out}


@dataclass(frozen=True)
class ReedSolomon(_Striped):
    """``m`` parity blocks over GF(2^8) from the systematic Cauchy matrix
    (:func:`gf256.cauchy_matrix`): any m losses are rebuilt; k + m <= 256."""

    m: int = 2  # type: ignore[assignment]  # a field where the base declares a property
    name: ClassVar[str] = "rs"
    M_RANGE: ClassVar[tuple[int, int]] = (1, 255)

    @classmethod
    def with_m(cls, m: int) -> RedundancyScheme:
        return cls(cls.resolve_m(m))

    def generator(self, c: int) -> np.ndarray:
        return _cauchy_generator(c, self.m)

    def code_json(self) -> dict[str, object]:
        return {"field": "gf256", "polynomial": POLYNOMIAL, "matrix": "cauchy"}

    def tolerates(self, k: int) -> int:
        return self.m

    def n_parity(self, k: int) -> int:
        return self.m

    def encode(self, data: Sequence[np.ndarray]) -> list[np.ndarray]:
        blocks = _blocks(data)
        g = gf256.cauchy_matrix(len(blocks), self.m)
        parity = [np.empty(blocks[0].size, np.uint8) for _ in range(self.m)]
        gf256.mul_add_blocks(g[len(blocks) :], blocks, parity)
        return parity

    def rebuild(
        self, k: int, blocks: Mapping[int, np.ndarray], lost: Sequence[int]
    ) -> dict[int, np.ndarray]:
        n = self._check(k, blocks, lost)
        lost_set = set(lost)
        if not lost_set:
            return {}
        g = gf256.cauchy_matrix(k, self.m)
        use = [i for i in range(k + self.m) if i in blocks and i not in lost_set][:k]
        data = {i: blocks[i] for i in use if i < k}
        lost_data = sorted(i for i in lost_set | set(range(k)) if i < k and i not in data)
        if lost_data:
            decode = gf256.mat_inv(g[use])  # data = decode . (the k surviving blocks)
            rebuilt = [np.empty(n, np.uint8) for _ in lost_data]
            gf256.mul_add_blocks(decode[lost_data], [blocks[i] for i in use], rebuilt)
            data.update(zip(lost_data, rebuilt))
        out = {i: data[i] for i in lost_data if i in lost_set}
        lost_parity = sorted(i for i in lost_set if i >= k)
        if lost_parity:
            parity = [np.empty(n, np.uint8) for _ in lost_parity]
            gf256.mul_add_blocks(g[lost_parity], [data[i] for i in range(k)], parity)
            out.update(zip(lost_parity, parity))
        return out


SCHEMES: dict[str, type[RedundancyScheme]] = {cls.name: cls for cls in (Partner, Xor, ReedSolomon)}


def scheme_of(name: str, m: int) -> RedundancyScheme:
    """The scheme object of a configuration or record: id ``name`` with ``m`` parity chunks per
    stripe (0: the scheme's default)."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise UsageError(f"unknown redundancy scheme {name!r} (known: {sorted(SCHEMES)})") from None
    return cls.with_m(m)


def scheme(name: str, m: int | None = None) -> RedundancyScheme:
    """The scheme with on-disk id ``name`` (``m`` parity blocks for ``"rs"``)."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise UsageError(f"unknown redundancy scheme {name!r} (known: {sorted(SCHEMES)})") from None
    if m is None:
        return cls()
    try:
        return cls(m)  # type: ignore[call-arg]
    except TypeError:
        raise UsageError(f"redundancy scheme {name!r} takes no parameter m") from None


@dataclass(frozen=True)
class Layout:
    """Where a set's redundancy lies (``spec/redundancy.md``, "Placement").

    ``padded`` is the length every member's data is zero-padded to; it is cut into
    ``n_chunks`` chunks of ``chunk`` bytes. Stripe ``r`` (``0 <= r < rows``) is one codeword:
    ``data[r][t]`` = (member, chunk index) of its data slot t, ``parity[r][p]`` = the member that
    stores its parity block p.
    """

    k: int
    m: int
    padded: int
    chunk: int
    n_chunks: int
    data: tuple[tuple[tuple[int, int], ...], ...]
    parity: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> int:
        return len(self.data)


def layout(k: int, m: int, member_bytes: Sequence[int]) -> Layout:
    """The striping of a set of ``k`` members with ``m`` parity chunks per stripe (m = 1: xor).

    Each member's data is split into ``k - m`` chunks; stripe r's parity is stored on members
    ``(r + p) % k`` (p < m) and its data slot t is chunk t of member ``(r + m + t) % k``. A node
    holds exactly one chunk of every stripe, so losing any m nodes loses at most m chunks of each
    stripe: every stripe is a (k - m) + m code that rebuilds them.
    """
    if len(member_bytes) != k or not 1 <= m < k or k > 256:
        raise UsageError(
            f"layout needs 1 <= m < k <= 256 and k sizes; got k={k}, m={m}, "
            f"{len(member_bytes)} sizes"
        )
    c = k - m
    longest = max(member_bytes)
    chunk = -(-longest // c)
    data = tuple(tuple(((r + m + t) % k, t) for t in range(c)) for r in range(k))
    parity = tuple(tuple((r + p) % k for p in range(m)) for r in range(k))
    return Layout(k, m, chunk * c, chunk, c, data, parity)
