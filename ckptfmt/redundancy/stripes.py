"""Stripe geometry of a redundancy set and the pure planning of a rebuild
(``spec/redundancy.md`` §4).

A set of ``n`` members with ``m`` parity chunks per stripe (``xor``: m = 1, ``rs``: m) has ``n``
stripes; stripe ``r`` is a codeword of ``c = n - m`` data positions and ``m`` parity positions:
data position ``t`` is chunk ``t`` of member ``(r + m + t) mod n``, parity ``p`` is chunk ``p`` of
member ``(r + p) mod n``'s parity file. ``partner`` has one "stripe" per member: member ``j``'s
data, copied whole as member ``(j + 1) mod n``'s parity file.

A rebuild is a list of :class:`Op`: ``dst[dst_kind][dst_index] ^= coef * src[src_kind][src_index]``
over GF(2^8), on zeroed destinations, in list order (lost data first, then lost parity, which
may need rebuilt data). A lost data chunk is decoded into a ``"tmp"`` chunk of one surviving
member of its stripe and then sent to its own member; a lost parity chunk likewise is summed on
its stripe's last data member. Encoding is the rebuild of every parity
chunk from intact data. The same list drives the collective rebuild (ops whose ends are on
different ranks become messages) and the offline one (everything local).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ckptfmt.errors import UnrecoverableError, UsageError
from ckptfmt.redundancy import gf256

WHOLE = -1  # partner: the whole member data / the whole copy


def data_member(n: int, m: int, r: int, t: int) -> int:
    """The member whose chunk ``t`` is data position ``t`` of stripe ``r``."""
    return (r + m + t) % n


def parity_member(n: int, r: int, p: int) -> int:
    """The member storing parity ``p`` of stripe ``r``."""
    return (r + p) % n


def parity_stripe(n: int, j: int, p: int) -> int:
    """The stripe whose parity ``p`` member ``j`` stores (as chunk ``p`` of its parity file)."""
    return (j - p) % n


@dataclass(frozen=True)
class Op:
    """``dst.<dst_kind>[dst_index] ^= coef * src.<src_kind>[src_index]`` (members by position;
    kinds ``"data"``/``"parity"``/``"tmp"``; an index is a chunk index, :data:`WHOLE`, or for
    ``"tmp"`` a scratch chunk's key)."""

    src: int
    src_kind: str
    src_index: int
    dst: int
    dst_kind: str
    dst_index: int
    coef: int


def plan_stripes(
    name: str,
    n: int,
    m: int,
    g: np.ndarray,
    data_lost: Collection[int],
    parity_lost: Collection[tuple[int, int]],
    via_tmp: bool = True,
) -> list[Op]:
    """The ops that rebuild the lost data of members ``data_lost`` and the lost parity chunks
    ``parity_lost`` (``(member, p)``) of one striped set whose code has the systematic generator
    ``g`` (``(c + m) x c``; ``via_tmp``: see :func:`_parity_ops`). Raises
    :class:`UnrecoverableError` (naming scheme ``name``, the lost members by position, parity as
    ``n + member``) when some stripe lost more than it tolerates."""
    data_lost, parity_lost = set(data_lost), set(parity_lost)
    c = n - m
    if c < 1:
        raise UsageError(f"a set of {n} cannot carry {m} parity chunks per stripe")
    ops: list[Op] = []
    for r in range(n):
        lost_t = [t for t in range(c) if data_member(n, m, r, t) in data_lost]
        if not lost_t:
            continue
        alive = [t for t in range(c) if t not in lost_t] + [
            c + p for p in range(m) if (parity_member(n, r, p), p) not in parity_lost
        ]
        if len(alive) < c:
            _unrecoverable(name, n, m, data_lost, parity_lost)
        use = alive[:c]
        decode = gf256.mat_inv(g[use])
        # the last surviving position's member decodes (for xor mostly the parity's, a different
        # member for each stripe) and sends the result on: the lost member takes in its own
        # size, not c times it, and the stripes' gathers run side by side
        decoder = _member_at(n, m, r, c, use[-1])
        for t in lost_t:
            tmp = r * c + t
            for u, pos in enumerate(use):
                coef = int(decode[t, u])
                if coef == 0:
                    continue
                src = _member_at(n, m, r, c, pos)
                kind, index = ("data", pos) if pos < c else ("parity", pos - c)
                ops.append(Op(src, kind, index, decoder, "tmp", tmp, coef))
            ops.append(Op(decoder, "tmp", tmp, data_member(n, m, r, t), "data", t, 1))
    for j, p in sorted(parity_lost):
        ops += _parity_ops(n, m, c, g, j, p, via_tmp)
    return ops


def _parity_ops(n: int, m: int, c: int, g: np.ndarray, j: int, p: int, via_tmp: bool) -> list[Op]:
    """The ops that recompute parity chunk ``p`` of member ``j`` from its stripe's data. With
    ``via_tmp``, summed into a ``"tmp"`` chunk of the stripe's last data member and sent on in
    one message (a lost node takes in its parity beside its data, not ``c`` times its size);
    else straight into the parity (all members local: no copy)."""
    r = parity_stripe(n, j, p)
    summer = data_member(n, m, r, c - 1)
    tmp = n * c + j * m + p  # above every data-decoding key (r * c + t)
    ops = []
    for t in range(c):
        coef = int(g[c + p, t])
        if coef:
            src = data_member(n, m, r, t)
            ops.append(
                Op(src, "data", t, summer, "tmp", tmp, coef)
                if via_tmp
                else Op(src, "data", t, j, "parity", p, coef)
            )
    if via_tmp:
        ops.append(Op(summer, "tmp", tmp, j, "parity", p, 1))
    return ops


def _member_at(n: int, m: int, r: int, c: int, pos: int) -> int:
    """The member holding codeword position ``pos`` of stripe ``r``."""
    return data_member(n, m, r, pos) if pos < c else parity_member(n, r, pos - c)


def plan_copies(
    name: str, n: int, data_lost: Collection[int], parity_lost: Collection[tuple[int, int]]
) -> list[Op]:
    """The ops that rebuild a set whose member j's parity is a whole copy of member j - 1's data
    (partner): a lost member's data from its copy, a lost copy from the data."""
    data_lost, parity_lost = set(data_lost), set(parity_lost)
    ops = []
    for j in sorted(data_lost):
        holder = (j + 1) % n
        if (holder, 0) in parity_lost:
            _unrecoverable(name, n, 0, data_lost, parity_lost)
        ops.append(Op(holder, "parity", WHOLE, j, "data", WHOLE, 1))
    for j, _p in sorted(parity_lost):
        ops.append(Op((j - 1) % n, "data", WHOLE, j, "parity", WHOLE, 1))
    return ops


def _unrecoverable(
    scheme: str, n: int, m: int, data_lost: set[int], parity_lost: set[tuple[int, int]]
) -> None:
    lost = sorted(data_lost) + sorted({n + j for j, _ in parity_lost})
    raise UnrecoverableError(scheme, lost, max(m, 1), n)
