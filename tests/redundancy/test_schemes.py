"""Redundancy sets and schemes (ckptfmt.redundancy; spec/redundancy.md).

Exhaustive erasure tests: for every scheme and set size 2..8, every combination of lost blocks up
to the scheme's tolerance rebuilds bit-exact, and every combination of one more raises
UnrecoverableError naming what is lost. A small reference decoder written from the spec alone
(``kit/gf256_ref.py``: per-byte Python arithmetic, nothing shared with gf256.py) decodes what
``rs`` encodes.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.gf256_ref import ref_inv, ref_mul, ref_rank, ref_solve

from ckptfmt.errors import CkptError, UsageError
from ckptfmt.redundancy import (
    SCHEMES,
    Partner,
    ReedSolomon,
    UnrecoverableError,
    Xor,
    gf256,
    isal,
    layout,
    make_sets,
    scheme,
)


def test_reference_decoder_reads_rs_from_the_spec() -> None:
    k, m, n = 3, 2, 7
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]
    parity = ReedSolomon(m).encode(data)
    # spec: parity row i, column j = 1 / ((k + i) XOR j)
    cauchy = [[ref_inv((k + i) ^ j) for j in range(k)] for i in range(m)]
    for i in range(m):
        expect = [0] * n
        for j in range(k):
            expect = [e ^ ref_mul(cauchy[i][j], int(b)) for e, b in zip(expect, data[j])]
        assert parity[i].tolist() == expect
    # lose data members 0 and 2; decode from member 1 and both parity blocks
    gen = [[1 if c == r else 0 for c in range(k)] for r in range(k)] + cauchy
    use = [1, 3, 4]
    blocks = [data[1].tolist(), parity[0].tolist(), parity[1].tolist()]
    solved = ref_solve([gen[u] for u in use], blocks)
    for j in range(k):
        assert solved[j] == data[j].tolist()


# --- GF(2^8) --------------------------------------------------------------------------------------

byte = st.integers(0, 255)


@given(byte, byte, byte)
def test_field_axioms(a: int, b: int, c: int) -> None:
    assert gf256.mul(a, b) == ref_mul(a, b) == gf256.mul(b, a)
    assert gf256.mul(gf256.mul(a, b), c) == gf256.mul(a, gf256.mul(b, c))
    assert gf256.mul(a, b ^ c) == gf256.mul(a, b) ^ gf256.mul(a, c)
    assert gf256.mul(a, 1) == a and gf256.mul(a, 0) == 0
    if a:
        assert gf256.mul(a, gf256.inv(a)) == 1
        assert gf256.inv(a) == ref_inv(a)


def test_tables() -> None:
    assert gf256.EXP[8] == 0x1D  # x^8 = x^4 + x^3 + x^2 + 1
    assert sorted(gf256.EXP[:255].tolist()) == list(range(1, 256))  # 2 generates the group
    with pytest.raises(ZeroDivisionError):
        gf256.inv(0)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, 4097, dtype=np.uint8)
    for c in (0, 1, 2, 0x8E, 255):
        want = np.array([ref_mul(c, int(v)) for v in x], np.uint8)
        assert np.array_equal(gf256.mul_arrays(np.uint8(c), x), want)
        assert np.array_equal(gf256.pair_table(c)[x[:-1].view(np.uint16)].view(np.uint8), want[:-1])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.lists(st.lists(byte, min_size=n, max_size=n), min_size=n, max_size=n)
    )
)
def test_mat_inv(rows: list[list[int]]) -> None:
    a = np.array(rows, np.uint8)
    n = len(rows)
    if ref_rank(rows) < n:
        with pytest.raises(ZeroDivisionError):
            gf256.mat_inv(a)
        return
    ai = gf256.mat_inv(a)
    eye = np.eye(n, dtype=np.uint8)
    assert np.array_equal(gf256.mat_mul(a, ai), eye)
    assert np.array_equal(gf256.mat_mul(ai, a), eye)


def test_scr_vandermonde_test_vector() -> None:
    g = gf256.scr_vandermonde_matrix(4, 2)
    assert np.array_equal(g[:4], np.eye(4, dtype=np.uint8))
    assert g[4:].tolist() == [[27, 28, 18, 20], [28, 27, 20, 18]]
    # the spec's test vector for ckptfmt's own (Cauchy) matrix
    assert gf256.cauchy_matrix(4, 2)[4:].tolist() == [[71, 167, 122, 186], [167, 71, 186, 122]]


def _singular_rows(g: np.ndarray, k: int) -> tuple[int, ...] | None:
    for rows in itertools.combinations(range(g.shape[0]), k):
        try:
            gf256.mat_inv(g[list(rows)])
        except ZeroDivisionError:
            return rows
    return None


@pytest.mark.parametrize(("k", "m"), [(2, 5), (4, 5), (6, 5), (5, 6), (8, 5), (3, 8)])
def test_cauchy_is_mds(k: int, m: int) -> None:
    assert _singular_rows(gf256.cauchy_matrix(k, m), k) is None
    # the reduced Vandermonde of SCR is MDS too (distinct points; column operations keep minors)
    assert _singular_rows(gf256.scr_vandermonde_matrix(k, m), k) is None


def test_isal_vandermonde_is_not_mds_for_m_5() -> None:
    g = gf256.isal_rs_matrix(6, 5)
    rows = _singular_rows(g, 6)
    assert rows is not None  # e.g. rows (1, 2, 4, 6, 7, 10)
    assert ref_rank([[int(v) for v in g[r]] for r in rows]) < 6


# --- schemes: exhaustive erasures -----------------------------------------------------------------

CASES = (
    [("partner", None, k) for k in range(2, 9)]
    + [("xor", None, k) for k in range(2, 9)]
    + [("rs", m, k) for m in (1, 2, 3) for k in range(2, 9) if k > m]
)


def _data(k: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]


@pytest.mark.parametrize(("name", "m", "k"), CASES)
@pytest.mark.parametrize("n", [0, 1, 37])
def test_every_erasure_up_to_tolerance(name: str, m: int | None, k: int, n: int) -> None:
    s = scheme(name, m)
    data = _data(k, n, seed=1000 * k + n)
    allb = data + s.encode(data)
    assert len(allb) == k + s.n_parity(k)
    t = s.tolerates(k)
    for size in range(t + 1):
        for lost in itertools.combinations(range(len(allb)), size):
            survivors = {i: b for i, b in enumerate(allb) if i not in lost}
            got = s.rebuild(k, survivors, lost)
            assert sorted(got) == list(lost)
            for i in lost:
                assert got[i].dtype == np.uint8 and np.array_equal(got[i], allb[i]), (lost, i)
    for lost in itertools.combinations(range(len(allb)), t + 1):
        survivors = {i: b for i, b in enumerate(allb) if i not in lost}
        if isinstance(s, Partner) and not any(i in lost and i + k in lost for i in range(k)):
            got = s.rebuild(k, survivors, lost)  # each member kept one of its two copies
            assert all(np.array_equal(got[i], allb[i]) for i in lost)
            continue
        with pytest.raises(UnrecoverableError) as exc:
            s.rebuild(k, survivors, lost)
        assert exc.value.lost == lost and exc.value.tolerates == t
        assert isinstance(exc.value, CkptError)
        assert f"data members {[i for i in lost if i < k]}" in str(exc.value)


@pytest.mark.parametrize("k", range(2, 9))
def test_partner_survives_a_node(k: int) -> None:
    data = _data(k, 33, seed=k)
    allb = data + Partner().encode(data)
    for node in range(k):  # node i holds member i and the copy of member i-1
        lost = (node, k + (node - 1) % k)
        got = Partner().rebuild(k, {i: b for i, b in enumerate(allb) if i not in lost}, lost)
        assert all(np.array_equal(got[i], allb[i]) for i in lost)


@pytest.mark.parametrize("name", ["xor", "rs"])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100])
def test_sliced_paths(monkeypatch: pytest.MonkeyPatch, name: str, n: int) -> None:
    monkeypatch.setattr(gf256, "SLICE", 16)  # exercise slice edges and odd tails cheaply
    s = scheme(name, 3 if name == "rs" else None)
    k = 5
    data = _data(k, n, seed=n)
    allb = data + s.encode(data)
    lost = tuple(range(s.tolerates(k)))
    got = s.rebuild(k, {i: b for i, b in enumerate(allb) if i not in lost}, lost)
    assert all(np.array_equal(got[i], allb[i]) for i in lost)
    if name == "rs":
        lost = (1, 5, 7)
        got = s.rebuild(k, {i: b for i, b in enumerate(allb) if i not in lost}, lost)
        assert all(np.array_equal(got[i], allb[i]) for i in lost)


def test_registry_and_errors() -> None:
    assert {"partner": Partner, "xor": Xor, "rs": ReedSolomon} == SCHEMES
    assert scheme("rs", 3).tolerates(6) == 3
    with pytest.raises(UsageError):
        scheme("raid")
    with pytest.raises(UsageError):
        scheme("xor", 2)
    with pytest.raises(UsageError):
        Xor().encode([np.zeros(3, np.uint8), np.zeros(4, np.uint8)])
    with pytest.raises(UsageError):
        Xor().rebuild(2, {0: np.zeros(1, np.uint8), 1: np.zeros(1, np.uint8)}, [5])


# --- placement ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "m"), [(k, m) for k in range(2, 9) for m in (1, 2, 3) if k > m])
def test_layout_survives_any_m_nodes(k: int, m: int) -> None:
    rng = np.random.default_rng(k * 10 + m)
    sizes = [int(v) for v in rng.integers(0, 50, k)]
    lay = layout(k, m, sizes)
    assert lay.padded == lay.chunk * (k - m) >= max(sizes) and lay.padded - max(sizes) < k - m
    members = [np.zeros(lay.padded, np.uint8) for _ in range(k)]
    for i, n in enumerate(sizes):
        members[i][:n] = rng.integers(0, 256, n, dtype=np.uint8)
    s = ReedSolomon(m) if m > 1 else Xor()
    c = lay.chunk
    stored: dict[int, dict[tuple[int, int], np.ndarray]] = {i: {} for i in range(k)}
    for r in range(lay.rows):  # node -> {(row, slot): bytes}; slot k-m+p is parity p
        held = [members[mem][t * c : (t + 1) * c] for mem, t in lay.data[r]]
        for t, (mem, _) in enumerate(lay.data[r]):
            stored[mem][(r, t)] = held[t]
        for p, b in enumerate(s.encode(held)):
            stored[lay.parity[r][p]][(r, k - m + p)] = b
    assert all(len(v) == lay.rows for v in stored.values())  # one chunk of each stripe per node
    for dead in itertools.combinations(range(k), m):
        for r in range(lay.rows):
            alive = {
                slot: b
                for node in range(k)
                if node not in dead
                for (row, slot), b in stored[node].items()
                if row == r
            }
            lost = [slot for node in dead for (row, slot) in stored[node] if row == r]
            got = s.rebuild(k - m, alive, lost)
            for slot in lost:
                if slot < k - m:
                    mem, t = lay.data[r][slot]
                    assert np.array_equal(got[slot], members[mem][t * c : (t + 1) * c])


# --- sets -----------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=80), st.integers(1, 8), st.integers(1, 8))
def test_sets_properties(node_ids: list[int], set_size: int, min_size: int) -> None:
    nodes = [f"n{i}" for i in node_ids]
    if min_size > set_size:
        with pytest.raises(UsageError):
            make_sets(nodes, set_size, min_size)
        return
    try:
        sets = make_sets(nodes, set_size, min_size)
    except UsageError:
        # exactly when the busiest node needs more sets of min_size than there are ranks
        assert len(nodes) < max(map(node_ids.count, node_ids)) * min_size
        return
    assert len(nodes) >= max(map(node_ids.count, node_ids)) * min_size
    flat = sorted(r for s in sets for r in s)
    assert flat == list(range(len(nodes)))
    for s in sets:
        assert len({nodes[r] for r in s}) == len(s)
        assert min_size <= len(s) <= len(set(nodes))
    assert make_sets(nodes, set_size, min_size) == sets


@given(st.integers(1, 12), st.integers(1, 6), st.integers(1, 8))
def test_sets_even_nodes(n_nodes: int, per_node: int, set_size: int) -> None:
    nodes = [f"h{r // per_node}" for r in range(n_nodes * per_node)]
    sets = make_sets(nodes, set_size, 1)
    for s in sets:
        assert set_size <= len(s) < 2 * set_size or len(s) == n_nodes < set_size
        assert len({r % per_node for r in s}) == 1  # same index inside their nodes


def test_sets_examples() -> None:
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert make_sets(nodes, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert make_sets(nodes, 8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # index rule: rank 5 (second on node e) joins the smallest set without a rank of node e
    assert make_sets(["a", "b", "c", "d", "e", "e"], 2, 2) == [[0, 1, 2, 5], [3, 4]]
    # the index rule would leave rank 1 alone: deal rule, 2 sets
    assert make_sets(["a", "a", "b", "c", "d"], 3, 2) == [[0, 2, 4], [1, 3]]
    with pytest.raises(UsageError, match="2 node"):
        make_sets(["a", "b", "a", "b"], 4, 3)


# --- ISA-L backend (ckptfmt.redundancy.isal, from pyeclib's wheel) --------------------------------
# Skipped only where pyeclib is not installed; where it is (CI), ISA-L must load and every test
# below runs against the real library.

HAVE_PYECLIB = importlib.util.find_spec("pyeclib") is not None
needs_pyeclib = pytest.mark.skipif(not HAVE_PYECLIB, reason="pyeclib (bundles ISA-L) not installed")


@pytest.fixture
def isal_backend() -> Iterator[None]:
    assert isal.available(), isal.load_error()
    gf256.set_backend("isal")
    yield
    gf256.set_backend("auto")


def _unaligned(rng: np.random.Generator, n: int, offset: int) -> np.ndarray:
    """n random bytes starting ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(n + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    a = raw[start : start + n]
    a[:] = rng.integers(0, 256, n, dtype=np.uint8)
    return a


@needs_pyeclib
def test_isal_loads() -> None:
    assert isal.available(), isal.load_error()
    assert isal.load_error() is None
    path = isal.library_path()
    assert path is not None and path.endswith(isal.LIBRARY_NAME)
    assert isal.version()
    assert gf256.backend() == "isal"  # "auto" picks it


@needs_pyeclib
def test_isal_field_is_0x11d() -> None:
    # scalar: every product
    got = np.array([[isal.gf_mul(a, b) for b in range(256)] for a in range(256)], np.uint8)
    assert np.array_equal(got, gf256.MUL)
    # vector kernels: all 256 constants at once (one output row each), 64-byte SIMD path and tail
    x = np.tile(np.arange(256, dtype=np.uint8), 3)[:700]
    outs = [np.full(x.size, 0xA5, np.uint8) for _ in range(256)]
    isal.encode_data(isal.init_tables(np.arange(256, dtype=np.uint8)[:, None]), [x], outs)
    for c in range(256):
        assert np.array_equal(outs[c], gf256.MUL[c][x]), c
        assert np.array_equal(isal.mul_table(c), isal.init_tables(np.array([[c]], np.uint8)).buf)


@needs_pyeclib
@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 2), (8, 2), (7, 1), (6, 5), (200, 56)])
def test_isal_cauchy_matrix_is_ours(k: int, m: int) -> None:
    assert np.array_equal(isal.cauchy1_matrix(k, m), gf256.cauchy_matrix(k, m))


SIZES = [0, 1, 2, 15, 31, 63, 64, 65, 127, 128, 1000, 4097, (1 << 20) + 1, (3 << 20) + 77]
SHAPES = [(1, 1), (3, 2), (8, 2), (7, 1), (10, 7), (20, 3)]  # (inputs, outputs)


@needs_pyeclib
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("k", "rows"), SHAPES)
def test_isal_mul_add_blocks_equals_numpy(isal_backend: None, n: int, k: int, rows: int) -> None:
    if n > 1 << 20 and k * rows > 24:
        n = 1 << 20 | 1  # keep the largest shapes quick; > 1 MiB still
    rng = np.random.default_rng(n * 31 + k * 7 + rows)
    coeffs = rng.integers(0, 256, (rows, k)).astype(np.uint8)
    coeffs[0, 0] = 0
    coeffs[-1, -1] = 1  # the numpy path's special cases
    for offset in (0, 1, 33):  # 64-byte aligned and not
        inputs = [_unaligned(rng, n, (offset + 5 * t) % 64) for t in range(k)]
        fast = [_unaligned(rng, n, offset) for _ in range(rows)]  # garbage: must be overwritten
        slow = [np.full(n, 0x5A, np.uint8) for _ in range(rows)]
        gf256.mul_add_blocks(coeffs, inputs, fast)
        gf256._mul_add_blocks_numpy(coeffs, inputs, slow)
        for r in range(rows):
            assert np.array_equal(fast[r], slow[r]), (offset, r)
    if n and n <= 4097:  # against the table directly
        want = np.zeros(n, np.uint8)
        for t in range(k):
            want ^= gf256.MUL[coeffs[0, t]][inputs[t]]
        assert np.array_equal(fast[0], want)


@needs_pyeclib
@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(0, 63),
    st.integers(1, 9),
    st.integers(1, 8),
    st.integers(0, 2**32 - 1),
)
def test_isal_mul_add_blocks_property(n: int, offset: int, k: int, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    coeffs = rng.integers(0, 256, (rows, k)).astype(np.uint8)
    inputs = [_unaligned(rng, n, offset) for _ in range(k)]
    fast = [np.empty(n, np.uint8) for _ in range(rows)]
    slow = [np.empty(n, np.uint8) for _ in range(rows)]
    gf256.set_backend("isal")
    try:
        gf256.mul_add_blocks(coeffs, inputs, fast)
    finally:
        gf256.set_backend("auto")
    gf256._mul_add_blocks_numpy(coeffs, inputs, slow)
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow))


@needs_pyeclib
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1001, (1 << 20) + 3])
def test_isal_mul_xor_into_equals_numpy(isal_backend: None, n: int) -> None:
    rng = np.random.default_rng(n)
    block = _unaligned(rng, n, 7)
    base = _unaligned(rng, n, 3)
    constants = range(256) if n <= 1001 else (0, 1, 2, 0x8E, 255)
    for c in constants:
        fast = base.copy()
        gf256.mul_xor_into(fast, c, block)
        slow = base.copy()
        if c:
            gf256._mul_xor_into_numpy(slow, c, block)
        assert np.array_equal(fast, slow), c
        if n <= 1001:
            assert np.array_equal(fast, base ^ gf256.MUL[c][block]), c
    same = base.copy()
    gf256.mul_xor_into(same, 0, block)
    assert np.array_equal(same, base)
    xored = base.copy()
    gf256.mul_xor_into(xored, 1, block)
    assert np.array_equal(xored, base ^ block)


def test_mul_xor_into_numpy_backend() -> None:
    rng = np.random.default_rng(5)
    block = rng.integers(0, 256, 4099, dtype=np.uint8)
    base = rng.integers(0, 256, 4099, dtype=np.uint8)
    gf256.set_backend("numpy")
    try:
        assert gf256.backend() == "numpy"
        for c in (0, 1, 2, 0x1D, 0x8E, 255):
            out = base.copy()
            gf256.mul_xor_into(out, c, block)
            assert np.array_equal(out, base ^ gf256.MUL[c][block]), c
    finally:
        gf256.set_backend("auto")


@needs_pyeclib
@pytest.mark.parametrize(("k", "m"), [(2, 1), (4, 2), (5, 3), (8, 2), (7, 1)])
@pytest.mark.parametrize("n", [0, 1, 37, 1000, 65537])
def test_reed_solomon_same_bytes_with_either_backend(k: int, m: int, n: int) -> None:
    assert isal.available(), isal.load_error()
    s = ReedSolomon(m)
    data = _data(k, n, seed=k * 100 + m * 10 + n)
    encoded: dict[str, list[np.ndarray]] = {}
    rebuilt: dict[str, dict[tuple[int, ...], dict[int, np.ndarray]]] = {}
    try:
        for name in ("isal", "numpy"):
            gf256.set_backend(name)
            assert gf256.backend() == name
            allb = data + s.encode(data)
            encoded[name] = allb
            rebuilt[name] = {}
            for size in range(1, m + 1):
                for lost in itertools.combinations(range(k + m), size):
                    survivors = {i: b for i, b in enumerate(allb) if i not in lost}
                    rebuilt[name][lost] = s.rebuild(k, survivors, lost)
    finally:
        gf256.set_backend("auto")
    assert all(np.array_equal(a, b) for a, b in zip(encoded["isal"], encoded["numpy"]))
    for lost, got in rebuilt["isal"].items():
        for i in lost:
            assert np.array_equal(got[i], rebuilt["numpy"][lost][i])
            assert np.array_equal(got[i], encoded["numpy"][i]), (lost, i)


@needs_pyeclib
@pytest.mark.parametrize("use", [(1, 3, 4), (3, 4, 0), (2, 4, 1)])
def test_reference_decoder_reads_isal_parity(isal_backend: None, use: tuple[int, ...]) -> None:
    k, m, n = 3, 2, 150  # >= 64 bytes: ISA-L's SIMD kernels, not its scalar tail
    rng = np.random.default_rng(11)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]
    parity = ReedSolomon(m).encode(data)
    cauchy = [[ref_inv((k + i) ^ j) for j in range(k)] for i in range(m)]
    gen = [[1 if c == r else 0 for c in range(k)] for r in range(k)] + cauchy
    allb = [d.tolist() for d in data] + [p.tolist() for p in parity]
    solved = ref_solve([gen[u] for u in use], [allb[u] for u in use])
    for j in range(k):
        assert solved[j] == data[j].tolist()


@needs_pyeclib
def test_pyeclib_isa_l_rs_cauchy_is_the_same_code() -> None:
    """The spec note: pyeclib's own ``isa_l_rs_cauchy`` parity is ckptfmt's ``rs`` parity."""
    ec_iface = pytest.importorskip("pyeclib.ec_iface")
    k, m = 8, 2
    driver = ec_iface.ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")
    rng = np.random.default_rng(3)
    for n in (8 * 4096, 1_000_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        frags = driver.encode(data.tobytes())
        header = 80  # liberasurecode's fragment header; the payload follows
        payload = [np.frombuffer(f, np.uint8)[header:] for f in frags]
        size = payload[0].size
        padded = np.zeros(k * size, np.uint8)
        padded[:n] = data
        blocks = [padded[t * size : (t + 1) * size] for t in range(k)]
        assert all(np.array_equal(payload[t], blocks[t]) for t in range(k))
        parity = ReedSolomon(m).encode(blocks)
        assert np.array_equal(parity[0], payload[k]) and np.array_equal(parity[1], payload[k + 1])


@needs_pyeclib
def test_isal_wrapper_checks() -> None:
    t = isal.init_tables(np.array([[1, 2], [3, 4]], np.uint8))
    a, b = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
    o1, o2 = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
    isal.encode_data(t, [a, b], [o1, o2])
    with pytest.raises(UsageError, match="C-contiguous"):
        isal.encode_data(t, [np.zeros(200, np.uint8)[::2], b], [o1, o2])
    with pytest.raises(UsageError, match="uint8"):
        isal.encode_data(t, [a.view(np.int8), b], [o1, o2])
    with pytest.raises(UsageError, match="lengths"):
        isal.encode_data(t, [a, b[:99]], [o1, o2])
    with pytest.raises(UsageError, match="lengths"):
        isal.encode_data(t, [a, b], [o1, o2[:50]])
    with pytest.raises(UsageError, match="2 inputs"):
        isal.encode_data(t, [a], [o1, o2])
    ro = np.zeros(100, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(UsageError, match="writable"):
        isal.encode_data(t, [a, b], [o1, ro])
    with pytest.raises(UsageError, match="input 2"):
        isal.encode_data_update(t, 2, a, [o1, o2])
    with pytest.raises(UsageError):
        isal.init_tables(np.zeros((0, 3), np.uint8))
    with pytest.raises(UsageError):
        isal.mul_table(256)


def test_gf256_checks_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError):
        gf256.set_backend("avx")
    ins = [np.arange(10, dtype=np.uint8), np.arange(10, dtype=np.uint8)]
    with pytest.raises(UsageError, match="coefficients of shape"):
        gf256.mul_add_blocks(np.ones((1, 3), np.uint8), ins, [np.zeros(10, np.uint8)])
    with pytest.raises(UsageError, match="expected 10"):
        gf256.mul_add_blocks(np.ones((1, 2), np.uint8), ins, [np.zeros(9, np.uint8)])
    with pytest.raises(UsageError, match=r"0\.\.255"):
        gf256.mul_xor_into(np.zeros(10, np.uint8), 256, ins[0])
    wide = np.arange(40, dtype=np.uint8)
    with pytest.raises(UsageError, match="contiguous"):  # on every backend
        gf256.mul_add_blocks(np.array([[3]], np.uint8), [wide[::2]], [np.zeros(20, np.uint8)])
    with pytest.raises(UsageError, match="uint8"):
        gf256.mul_xor_into(np.zeros(20, np.int16), 3, wide[:20])
    # without ISA-L, "auto" is numpy and "isal" is refused; results are unchanged
    monkeypatch.setattr(isal, "_LIB", None)
    assert not isal.available()
    assert gf256.backend() == "numpy"
    with pytest.raises(UsageError, match="not available"):
        gf256.set_backend("isal")
    data = _data(4, 333, seed=4)
    parity = ReedSolomon(2).encode(data)
    lost = (0, 3)
    got = ReedSolomon(2).rebuild(
        4, {i: b for i, b in enumerate(data + parity) if i not in lost}, lost
    )
    assert all(np.array_equal(got[i], data[i]) for i in lost)
