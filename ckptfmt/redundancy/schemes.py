"""Redundancy schemes: the same two verbs for each (``encode``, ``rebuild``), a ``tolerates``
count, and a registry from the on-disk id to the class (``spec/redundancy.md``).

A scheme works on *blocks*: ``k`` data blocks of one length (indices ``0..k-1``) and the
``n_parity(k)`` blocks it derives from them (indices ``k..``). How a set's member files become
blocks and where each block is stored is :func:`layout`'s business.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ckptfmt.errors import UnrecoverableError as UnrecoverableError  # re-exported
from ckptfmt.errors import UsageError
from ckptfmt.redundancy import gf256


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


class Xor(RedundancyScheme):
    """One parity block, the XOR of the k members (RAID-5): any one loss is rebuilt."""

    name = "xor"

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
class ReedSolomon(RedundancyScheme):
    """``m`` parity blocks over GF(2^8) from the systematic Cauchy matrix
    (:func:`gf256.cauchy_matrix`): any m losses are rebuilt; k + m <= 256."""

    m: int = 2
    name: ClassVar[str] = "rs"

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
