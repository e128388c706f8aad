"""GF(2^8) arithmetic written from spec/redundancy.md alone (per-byte Python, nothing shared with
``ckptfmt.redundancy.gf256``): the reference decoder the redundancy tests check ``rs`` and the
tables against."""

from __future__ import annotations


def ref_mul(a: int, b: int) -> int:
    p = 0
    while b:
        if b & 1:
            p ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return p


def ref_inv(a: int) -> int:
    r = 1
    for _ in range(254):  # a^254 = a^-1 in GF(2^8)
        r = ref_mul(r, a)
    return r


def ref_solve(rows: list[list[int]], rhs: list[list[int]]) -> list[list[int]]:
    """Solve rows . X = rhs over GF(2^8) by Gauss-Jordan; rows k x k, rhs k x n."""
    k = len(rows)
    a = [list(r) + list(b) for r, b in zip(rows, rhs)]
    for c in range(k):
        p = next(i for i in range(c, k) if a[i][c])
        a[c], a[p] = a[p], a[c]
        f = ref_inv(a[c][c])
        a[c] = [ref_mul(f, v) for v in a[c]]
        for i in range(k):
            if i != c and a[i][c]:
                g = a[i][c]
                a[i] = [v ^ ref_mul(g, w) for v, w in zip(a[i], a[c])]
    return [r[k:] for r in a]


def ref_rank(rows: list[list[int]]) -> int:
    a = [list(r) for r in rows]
    rank = 0
    for c in range(len(a[0]) if a else 0):
        p = next((i for i in range(rank, len(a)) if a[i][c]), None)
        if p is None:
            continue
        a[rank], a[p] = a[p], a[rank]
        f = ref_inv(a[rank][c])
        a[rank] = [ref_mul(f, v) for v in a[rank]]
        for i in range(len(a)):
            if i != rank and a[i][c]:
                g = a[i][c]
                a[i] = [v ^ ref_mul(g, w) for v, w in zip(a[i], a[rank])]
        rank += 1
    return rank
