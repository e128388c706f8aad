"""Redundancy sets end to end in one process: the striped layout of ``spec/redundancy.md`` §4 as
the engine writes it (the scheme object's ``encode_plan``/``rebuild_plan`` run by
``engine.run_ops``), and the
offline repair of real checkpoints (``ckptfmt.maintenance.repair``).

For partner, xor and rs (m = 1, 2, 3) and sets of 2..8 members whose data has odd and zero
lengths: the engine's parity is exactly what a reference encoder written from the spec computes
(per byte, with the reference field arithmetic of ``kit/gf256_ref.py``), and the reference decoder
rebuilds lost members from it (so the spec says enough to read what ckptfmt writes). Losses are
enumerated at two grains: whole members (a node: its data and its parity file) and single pieces
(one member's data, or one parity chunk). Every loss the spec says is recoverable (no stripe that
lost data lost more than ``m`` positions; partner: no member lost both copies) rebuilds bit-exact,
data and parity; every other raises ``UnrecoverableError``; and one loss beyond the tolerance is
unrecoverable whenever it costs a stripe data and more than ``m`` positions.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kit.faults import flip
from kit.files import tree
from kit.gf256_ref import ref_inv, ref_mul, ref_solve
from kit.level1 import NODES4, NODES8, merge, save_level1, whole

import ckptfmt
from ckptfmt import WriteOptions
from ckptfmt.errors import CkptError, UnrecoverableDamageError
from ckptfmt.maintenance.repair import rebuild
from ckptfmt.manifest.codec import parse_manifest
from ckptfmt.redundancy.engine import MemberBuffers, run_ops, scratch
from ckptfmt.redundancy.record import member_files, record_of
from ckptfmt.redundancy.schemes import UnrecoverableError, scheme_of

CASES = (
    [("partner", 0, n) for n in range(2, 9)]
    + [("xor", 1, n) for n in range(2, 9)]
    + [("rs", m, n) for m in (1, 2, 3) for n in range(m + 1, 9)]
)
# piece grain: every k-subset when there are at most this many (within the tolerance / beyond it),
# else SAMPLE random ones: exhaustive up to the tolerance for every set of up to 6 members
EXHAUSTIVE_WITHIN = 2100
EXHAUSTIVE_BEYOND = 600
SAMPLE = 150

Piece = tuple[str, int, int]  # ("data", member, 0) | ("parity", member, chunk p)


# --- the spec, independently ----------------------------------------------------------------------


def geometry(scheme: str, m: int, sizes: list[int]) -> tuple[int, int]:
    """(chunk S, padded length P) of a set, §4."""
    n, longest = len(sizes), max(sizes)
    if scheme == "partner":
        return longest, longest
    chunk = -(-longest // (n - m))
    return chunk, chunk * (n - m)


def spec_rows(scheme: str, c: int, m: int) -> list[list[int]]:
    """Rows of the generator ``[I; C]`` over codeword positions, §3 (reference arithmetic)."""
    eye = [[int(i == t) for t in range(c)] for i in range(c)]
    if scheme == "xor":
        return [*eye, [1] * c]
    return eye + [[ref_inv((c + p) ^ t) for t in range(c)] for p in range(m)]


def position(n: int, m: int, r: int, pos: int) -> Piece:
    """What codeword position ``pos`` of stripe ``r`` is, §4: data chunk or stored parity."""
    c = n - m
    if pos < c:
        return ("data", (r + m + pos) % n, pos)
    return ("parity", (r + pos - c) % n, pos - c)


def piece_bytes(data: list[bytes], parity: list[bytes], piece: Piece, chunk: int) -> list[int]:
    kind, j, t = piece
    src = data[j] if kind == "data" else parity[j]
    return list(src[t * chunk : (t + 1) * chunk])


def spec_encode(scheme: str, m: int, data: list[bytes], sizes: list[int]) -> list[bytes]:
    """Every member's parity file, from the padded member data, by §4 and §5."""
    n = len(data)
    if scheme == "partner":
        return [data[(j - 1) % n][: sizes[(j - 1) % n]] for j in range(n)]
    chunk, _ = geometry(scheme, m, sizes)
    c = n - m
    rows = spec_rows(scheme, c, m)
    files = [bytearray(m * chunk) for _ in range(n)]
    for r in range(n):
        d = [piece_bytes(data, [], position(n, m, r, t), chunk) for t in range(c)]
        for p in range(m):
            q = [0] * chunk
            for t in range(c):
                q = [a ^ ref_mul(rows[c + p][t], b) for a, b in zip(q, d[t])]
            files[(r + p) % n][p * chunk : (p + 1) * chunk] = bytes(q)
    return [bytes(f) for f in files]


def spec_decode(
    scheme: str, m: int, data: list[bytes], parity: list[bytes], sizes: list[int], lost: set[int]
) -> dict[int, bytes]:
    """The data of the members ``lost`` (whole nodes), from what the others store: per stripe,
    the first ``c`` surviving positions, solved against their generator rows (§3, §7)."""
    n = len(data)
    if scheme == "partner":
        return {j: parity[(j + 1) % n] for j in lost}
    chunk, padded = geometry(scheme, m, sizes)
    c = n - m
    rows = spec_rows(scheme, c, m)
    out = {j: bytearray(padded) for j in lost}
    for r in range(n):
        alive = [pos for pos in range(n) if position(n, m, r, pos)[1] not in lost][:c]
        rhs = [piece_bytes(data, parity, position(n, m, r, pos), chunk) for pos in alive]
        solved = ref_solve([rows[pos] for pos in alive], rhs) if chunk else [[]] * c
        for t in range(c):
            _, j, _ = position(n, m, r, t)
            if j in lost:
                out[j][t * chunk : (t + 1) * chunk] = bytes(solved[t])
    return {j: bytes(b) for j, b in out.items()}


def spec_recoverable(scheme: str, n: int, m: int, lost: set[Piece]) -> bool:
    """§7: partner fails when a member lost both copies; xor/rs when a stripe that lost data
    lost more than ``m`` of its positions (lost parity alone is recomputed from the data)."""
    if scheme == "partner":
        return not any(
            ("data", j, 0) in lost and ("parity", (j + 1) % n, 0) in lost for j in range(n)
        )
    for r in range(n):
        gone = [pos for pos in range(n) if _lost(position(n, m, r, pos), lost)]
        if any(pos < n - m for pos in gone) and len(gone) > m:
            return False
    return True


def _lost(piece: Piece, lost: set[Piece]) -> bool:
    kind, j, _ = piece
    return ("data", j, 0) in lost if kind == "data" else piece in lost


# --- the engine -----------------------------------------------------------------------------------


def member_sizes(n: int, seed: int) -> list[int]:
    """Odd and zero lengths: one member empty, the longest odd."""
    rng = np.random.default_rng(seed)
    sizes = [int(v) for v in rng.integers(0, 48, n)]
    sizes[seed % n] = 0
    sizes[(seed + 1) % n] = 2 * int(rng.integers(10, 30)) + 1
    return sizes


def encode(scheme: str, m: int, sizes: list[int], seed: int) -> dict[int, MemberBuffers]:
    """Random member data (zero-padded) and the engine's parity, every member local."""
    rng = np.random.default_rng(seed + 1)
    n = len(sizes)
    chunk, padded = geometry(scheme, m, sizes)
    local = {}
    for j in range(n):
        data = np.zeros(padded if scheme != "partner" else sizes[j], np.uint8)
        data[: sizes[j]] = rng.integers(0, 256, sizes[j], dtype=np.uint8)
        n_parity = sizes[(j - 1) % n] if scheme == "partner" else m * chunk
        # the ops xor into their destinations: parity starts zeroed
        local[j] = MemberBuffers(data, np.zeros(n_parity, np.uint8))
    run_ops(scheme_of(scheme, m).encode_plan(n), [100 + j for j in range(n)], sizes, chunk, local)
    return local


def pieces(scheme: str, n: int, m: int) -> list[Piece]:
    return [("data", j, 0) for j in range(n)] + [
        ("parity", j, p) for j in range(n) for p in range(max(m, 1))
    ]


def attempt(
    scheme: str, m: int, sizes: list[int], good: dict[int, MemberBuffers], lost: set[Piece]
) -> None:
    """Rebuild ``lost`` from copies of ``good`` (lost bytes zeroed, as repair does) and check it
    against the spec's verdict: bit-exact everywhere, or :class:`UnrecoverableError`."""
    n = len(sizes)
    chunk, _ = geometry(scheme, m, sizes)
    data_lost = sorted(j for kind, j, _ in lost if kind == "data")
    parity_lost = sorted((j, p) for kind, j, p in lost if kind == "parity")
    if not spec_recoverable(scheme, n, m, lost):
        with pytest.raises(UnrecoverableError) as exc:
            scheme_of(scheme, m).rebuild_plan(n, data_lost, parity_lost)
        assert isinstance(exc.value, CkptError)
        assert set(exc.value.lost) == set(data_lost) | {n + j for j, _ in parity_lost}
        return
    ops = scheme_of(scheme, m).rebuild_plan(n, data_lost, parity_lost)
    bufs = {j: MemberBuffers(b.data.copy(), b.parity.copy()) for j, b in good.items()}
    for j in data_lost:
        bufs[j].data[:] = 0
    step = chunk if scheme != "partner" else None
    for j, p in parity_lost:
        if step is None:
            bufs[j].parity[:] = 0
        else:
            bufs[j].parity[p * step : (p + 1) * step] = 0
    run_ops(ops, [100 + j for j in range(n)], sizes, chunk, bufs)
    for j in range(n):
        assert np.array_equal(bufs[j].data, good[j].data), (sorted(lost), "data", j)
        assert np.array_equal(bufs[j].parity, good[j].parity), (sorted(lost), "parity", j)


def one_stripe_too_many(scheme: str, n: int, m: int) -> Iterator[tuple[Piece, ...]]:
    """For each stripe, a data position and ``m`` more of its positions: one beyond what it
    rebuilds (partner: a member's data and its copy)."""
    if scheme == "partner":
        for j in range(n):
            yield (("data", j, 0), ("parity", (j + 1) % n, 0))
        return
    for r in range(n):
        for first in range(n - m):  # each data position, with the next m positions (mod n)
            chosen = [position(n, m, r, (first + i) % n) for i in range(m + 1)]
            yield tuple(("data", j, 0) if kind == "data" else (kind, j, t) for kind, j, t in chosen)


def subsets(
    units: list[Piece], k: int, beyond: bool, rng: random.Random
) -> Iterator[tuple[Piece, ...]]:
    """Every ``k``-subset of ``units`` when few, else :data:`SAMPLE` random ones."""
    if math.comb(len(units), k) <= (EXHAUSTIVE_BEYOND if beyond else EXHAUSTIVE_WITHIN):
        yield from itertools.combinations(units, k)
    else:
        for _ in range(SAMPLE):
            yield tuple(rng.sample(units, k))


def tolerance(scheme: str, m: int) -> int:
    return 1 if scheme == "partner" else m


@pytest.mark.parametrize(("scheme", "m", "n"), CASES)
def test_engine_parity_is_the_spec_parity(scheme: str, m: int, n: int) -> None:
    sizes = member_sizes(n, seed=n * 10 + m)
    local = encode(scheme, m, sizes, seed=n * 10 + m)
    data = [local[j].data.tobytes() for j in range(n)]
    want = spec_encode(scheme, m, data, sizes)
    for j in range(n):
        assert local[j].parity.tobytes() == want[j], j
    # the reference decoder reads the members back from what the engine stored
    for lost in {tuple(range(tolerance(scheme, m))), tuple(range(n - tolerance(scheme, m), n))}:
        parity = [local[j].parity.tobytes() for j in range(n)]
        got = spec_decode(scheme, m, data, parity, sizes, set(lost))
        for j in lost:
            assert got[j] == data[j], (lost, j)


@pytest.mark.parametrize(("scheme", "m", "n"), CASES)
@pytest.mark.parametrize("empty", [False, True], ids=["odd", "all-empty"])
def test_every_node_loss(scheme: str, m: int, n: int, empty: bool) -> None:
    """Whole members (a node: data and parity file): every subset up to the tolerance rebuilds,
    every subset one larger fails when the spec says so (always, for xor/rs)."""
    sizes = [0] * n if empty else member_sizes(n, seed=n + m)
    good = encode(scheme, m, sizes, seed=n + m)
    k_max = tolerance(scheme, m)
    for k in range(min(k_max + 1, n) + 1):
        for members in itertools.combinations(range(n), k):
            lost = {("data", j, 0) for j in members}
            lost |= {("parity", j, p) for j in members for p in range(max(m, 1))}
            if scheme != "partner" and k == k_max + 1:
                assert not spec_recoverable(scheme, n, m, lost)
            attempt(scheme, m, sizes, good, lost)


@pytest.mark.parametrize(("scheme", "m", "n"), CASES)
def test_every_piece_loss(scheme: str, m: int, n: int) -> None:
    """Single pieces (one member's data, one parity chunk): every subset up to the tolerance
    (sampled for the largest sets), then subsets one piece beyond it (and, for each stripe, one
    piece too many of that stripe); parity alone, data alone and both together are all among
    them."""
    sizes = member_sizes(n, seed=3 * n + m)
    good = encode(scheme, m, sizes, seed=3 * n + m)
    units = pieces(scheme, n, m)
    rng = random.Random(f"{scheme}{m}{n}")
    k_max = tolerance(scheme, m)
    seen = {"parity only": 0, "data only": 0, "mixed": 0, "unrecoverable": 0}
    for k in range(k_max + 2):
        for combo in subsets(units, k, k > k_max, rng):
            lost = set(combo)
            kinds = {kind for kind, _, _ in lost}
            if kinds == {"parity"}:
                seen["parity only"] += 1
            elif kinds == {"data"}:
                seen["data only"] += 1
            elif kinds:
                seen["mixed"] += 1
            if k <= k_max:
                assert spec_recoverable(scheme, n, m, lost)  # within the tolerance: always
            elif not spec_recoverable(scheme, n, m, lost):
                seen["unrecoverable"] += 1
            attempt(scheme, m, sizes, good, lost)
    for combo in one_stripe_too_many(scheme, n, m):
        lost = set(combo)
        assert not spec_recoverable(scheme, n, m, lost), combo
        seen["unrecoverable"] += 1
        attempt(scheme, m, sizes, good, lost)
    assert seen["parity only"] and seen["data only"] and seen["unrecoverable"], seen
    assert seen["mixed"], seen


# --- offline repair of real checkpoints: a corrupt member instead of a missing one ----------------


SCHEMES = ["partner", "xor", {"scheme": "rs", "m": 2}]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("red", SCHEMES, ids=["partner", "xor", "rs2"])
def test_repair_replaces_corrupt_data_and_parity(red: object, tmp_path: Path) -> None:
    template = save_level1(tmp_path / "l1", red)
    root = tmp_path / "l1"
    healthy = _files(root)
    manifest = parse_manifest((root / "n0" / "ckptfmt.json").read_bytes())
    record = record_of(manifest)
    assert record is not None
    # rank 2 (n1): one data file bit-flipped; rank 7 (n3): its parity file's last chunk damaged
    victim = member_files(manifest, 2)[-1][1].path
    flip(root / "n1" / victim)
    parity = root / "n3" / "ckptfmt-redundancy" / "7"
    flip(parity, byte=parity.stat().st_size - 1)
    assert not ckptfmt.verify(template).healthy

    before = tree(root)
    dry = rebuild(template, write=WriteOptions(fsync=False), dry_run=True)
    assert dry.lost_data == [2] and dry.lost_parity == [7] and dry.recreated == []
    assert tree(root) == before  # a dry run writes nothing

    report = rebuild(template, write=WriteOptions(fsync=False))
    assert report.lost_data == [2] and report.lost_parity == [7]
    assert report.lost_nodes == ["n1", "n3"] and report.recreated == []
    assert sorted(report.files_written) == sorted(
        [f"{root / 'n1'}: {victim}", f"{root / 'n3'}: ckptfmt-redundancy/7"]
    )
    assert _files(root) == healthy  # bit for bit what the save wrote, nothing else
    assert ckptfmt.verify(template).healthy
    assert not rebuild(template, write=WriteOptions(fsync=False)).repaired


@pytest.mark.parametrize("red", SCHEMES, ids=["partner", "xor", "rs2"])
def test_repair_of_every_lost_node_and_one_more(red: object, tmp_path: Path) -> None:
    """Each node's directory lost in turn (two at once for rs m=2) is recreated bit for bit;
    with partner two neighbours, with xor any two nodes, with rs any three: unrecoverable, and
    nothing is written."""
    import shutil

    root = tmp_path / "l1"
    template = save_level1(root, red, NODES4)
    healthy = _files(root)
    rs = isinstance(red, dict)
    for lost in itertools.combinations(NODES4, 2 if rs else 1):
        for node in lost:
            shutil.rmtree(root / node)
        report = rebuild(template, write=WriteOptions(fsync=False))
        assert sorted(Path(d).name for d in report.recreated) == list(lost)
        assert _files(root) == healthy, lost
    beyond = [("n0", "n1", "n2")] if rs else [("n1", "n2")] if red == "partner" else [("n0", "n3")]
    for lost in beyond:
        for node in lost:
            shutil.rmtree(root / node)
        before = _files(root)
        with pytest.raises(UnrecoverableDamageError) as exc:
            rebuild(template, write=WriteOptions(fsync=False))
        assert set(exc.value.nodes) <= set(lost) and exc.value.lost_ranks
        assert exc.value.tensors
        assert _files(root) == before
    # what survives is still what was saved
    assert all(healthy[k] == v for k, v in _files(root).items())


@pytest.mark.parametrize("red", SCHEMES, ids=["partner", "xor", "rs2"])
def test_rebuilt_node_loads_as_saved(red: object, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "l1"
    template = save_level1(root, red, NODES8, seed=4)
    shutil.rmtree(root / "n2")
    rebuild(template, write=WriteOptions(fsync=False))
    state = ckptfmt.load(merge(root, NODES8, tmp_path / "all"))
    for name, want in whole(len(NODES8), seed=4).items():
        got = state
        for part in name.split("/"):
            got = got[part]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


def test_repair_reads_one_directory_holding_every_node(tmp_path: Path) -> None:
    """The third form: one directory with every node's files (and all the parity files)."""
    root = tmp_path / "l1"
    save_level1(root, "xor", NODES8)
    one = merge(root, NODES8, tmp_path / "all")
    healthy = _files(one)
    manifest = parse_manifest((one / "ckptfmt.json").read_bytes())
    victim = member_files(manifest, 5)[0][1].path
    (one / victim).unlink()
    report = rebuild(one, write=WriteOptions(fsync=False))
    assert report.lost_data == [5] and report.lost_parity == []
    assert _files(one) == healthy
    assert ckptfmt.verify(one).healthy


@pytest.mark.parametrize(("scheme", "m", "n"), [("xor", 1, 2), ("xor", 1, 4), ("rs", 2, 5)])
def test_decoding_scratch_is_reused_and_starts_zeroed(scheme: str, m: int, n: int) -> None:
    """The ``"tmp"`` chunks the ops decode into are cut from this thread's reused scratch (no
    fresh pages faulted in at every rebuild); left dirty by anything before, they are zeroed
    before the ops XOR into them, so every rebuild is still bit-exact."""
    sizes = member_sizes(n, seed=7 * n + m)
    good = encode(scheme, m, sizes, seed=7 * n + m)
    chunk, _ = geometry(scheme, m, sizes)
    lost = {("data", 1, 0)} | {("parity", 1, p) for p in range(m)}
    for _ in range(2):
        scratch(n * n * chunk, "tmp")[:] = 0xFF  # garbage where the chunks will be cut
        attempt(scheme, m, sizes, good, lost)
    ops = scheme_of(scheme, m).rebuild_plan(n, [1], [(1, p) for p in range(m)])
    bufs = {j: MemberBuffers(b.data.copy(), b.parity.copy()) for j, b in good.items()}
    taken: list[np.ndarray] = []
    for b in bufs.values():  # note each chunk as the ops consume it
        b.tmp = _Noting(taken)
    run_ops(ops, [100 + j for j in range(n)], sizes, chunk, bufs)
    region = scratch(1, "tmp")
    assert taken and all(np.shares_memory(t, region.base) for t in taken)


class _Noting(dict):  # type: ignore[type-arg]
    """A ``MemberBuffers.tmp`` that records every chunk put into it."""

    def __init__(self, taken: list[np.ndarray]) -> None:
        super().__init__()
        self.taken = taken

    def __setitem__(self, key: object, value: np.ndarray) -> None:
        self.taken.append(value)
        super().__setitem__(key, value)
