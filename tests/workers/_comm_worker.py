"""A rank of a multi-process ``Comm`` test: ``_comm_worker.py mpi|torch SCENARIO[,...] OUTDIR``.

Run under ``mpiexec ... python -m mpi4py`` (``mpi``: ``MpiComm``) or ``torchrun`` (``torch``:
``TorchComm`` over gloo). Each rank checks what it received itself (exit status nonzero on any
failed check) and writes it to ``OUTDIR/SCENARIO/`` (``rank<r>.json`` plus ``.npy`` arrays) for
the parent test to check again against the expected values, which :func:`payload` and friends
define here for both sides.

Scenarios: ``collectives``, ``dup`` (a thread on ``comm.dup()`` beside the main thread on
``comm``) and ``background_abort`` (a failing ``start_background`` target on rank 1 must end the
job while the other ranks wait in a barrier).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from kit.worker import end_torch_job, make_comm

BCAST_BYTES = 20 * 1000 * 1000
RING_BYTES = 100_003
DUP_ROUNDS = 60


class CheckFailed(Exception):
    """A value received by this rank is not the expected one."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# --- expected values (shared with the parent test) --------------------------------------------


def payload(rank: int, size: int, salt: int = 0) -> bytes:
    """Rank ``rank``'s bytes for allgather_bytes: empty on rank 0, lengths differing per rank."""
    n = [0, 1, 1000, 65_537, 7][rank % 5] + (rank // 5) * 3
    rng = np.random.default_rng([rank, size, salt])
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def json_doc(rank: int) -> dict[str, Any]:
    return {"rank": rank, "name": f"rang-{rank}-\u00e9\u4e2d", "vals": [rank, rank / 4, None]}


def bcast_doc() -> dict[str, Any]:
    return {"from": 1, "nested": {"a": [1, 2.5, "x"], "b": True}, "text": "\u00fc" * 300}


def bcast_array(size: int) -> np.ndarray:
    return np.random.default_rng([size, 99]).integers(0, 256, BCAST_BYTES, dtype=np.uint8)


def bf16_array(sender: int, tag: int) -> np.ndarray:
    """bfloat16 values including bit patterns a value copy would alter (NaN payloads, -0,
    subnormals, infinities)."""
    special = np.array([0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7F81], np.uint16)
    rng = np.random.default_rng([sender, tag])
    bits = np.concatenate([special, rng.integers(0, 1 << 16, 5000, dtype=np.uint16)])
    return bits.view(ml_dtypes.bfloat16)


def ring_array(rank: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng([rank, 7, salt]).integers(0, 256, RING_BYTES, dtype=np.uint8)


def sha(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(bytes(data) if isinstance(data, bytes) else data.tobytes()).hexdigest()


# --- scenarios ---------------------------------------------------------------------------------


def collectives(comm: Any, out: Path) -> dict[str, Any]:
    r, n = comm.rank, comm.size
    res: dict[str, Any] = {"rank": r, "size": n}

    blobs = comm.allgather_bytes(payload(r, n))
    check([len(b) for b in blobs] == [len(payload(j, n)) for j in range(n)], "allgather lengths")
    for j, b in enumerate(blobs):
        check(b == payload(j, n), f"allgather_bytes: bytes of rank {j}")
    res["allgather_sha"] = [sha(b) for b in blobs]
    res["allgather_len"] = [len(b) for b in blobs]
    res["allgather_empty"] = [len(b) for b in comm.allgather_bytes(b"")]
    check(res["allgather_empty"] == [0] * n, "allgather of empty bytes")

    res["allgather_json"] = comm.allgather_json(json_doc(r))
    check(res["allgather_json"] == [json_doc(j) for j in range(n)], "allgather_json")

    res["bcast_json"] = comm.bcast_json(bcast_doc() if r == 1 else {"junk": r}, root=1)
    check(res["bcast_json"] == bcast_doc(), "bcast_json from root 1")

    res["all_true_yes"] = comm.all_true(True)
    res["all_true_no"] = comm.all_true(r != n - 1)
    res["min_int"] = comm.min_int(100 - 7 * r)
    res["min_int_neg"] = comm.min_int(-(10**12) if r == 1 else r)
    check(res["all_true_yes"] is True and res["all_true_no"] is False, "all_true")
    check(res["min_int"] == 100 - 7 * (n - 1) and res["min_int_neg"] == -(10**12), "min_int")

    root = n - 1
    big = bcast_array(n) if r == root else np.zeros(BCAST_BYTES, np.uint8)
    before = big.__array_interface__["data"][0]
    comm.bcast_buffer(big, root)
    check(big.__array_interface__["data"][0] == before, "bcast_buffer replaced the buffer")
    check(np.array_equal(big, bcast_array(n)), f"bcast_buffer of {BCAST_BYTES} bytes from {root}")
    res["bcast_sha"] = sha(big)
    del big

    # bfloat16 between pairs (0,1), (2,3), ...; there and back, distinct tags
    peer = r ^ 1
    if peer < n:
        if r % 2 == 0:
            comm.send(bf16_array(r, 5).view(np.uint8), peer, tag=5)
            got = np.empty(len(bf16_array(peer, 6)), ml_dtypes.bfloat16)
            comm.recv(got.view(np.uint8), peer, tag=6)
        else:
            got = np.empty(len(bf16_array(peer, 5)), ml_dtypes.bfloat16)
            comm.recv(got.view(np.uint8), peer, tag=5)
            comm.send(bf16_array(r, 6).view(np.uint8), peer, tag=6)
        want = bf16_array(peer, 5 if r % 2 else 6)
        check(got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), "bf16 recv bits")
        np.save(out / f"rank{r}_bf16.npy", got.view(np.uint16))
        res["bf16_peer"] = peer

    # a ring: everyone sends right and receives from the left at once
    left, right = (r - 1) % n, (r + 1) % n
    got_ring = np.zeros(RING_BYTES, np.uint8)
    comm.sendrecv(ring_array(r), right, got_ring, left, tag=3)
    check(np.array_equal(got_ring, ring_array(left)), "sendrecv ring")
    np.save(out / f"rank{r}_ring.npy", got_ring)

    # start_exchange: rounds d = 1 .. n-1 of two pairs each (to r + d, from r - d), round d + 1
    # started before round d's buffers are checked (what the redundancy encoding does)
    res["exchange_sha"] = []
    bufs = [[np.zeros(RING_BYTES, np.uint8) for _ in range(2)] for _ in range(2)]

    def start(d: int) -> Any:
        pairs = [
            (ring_array(r, k * 100 + d), (r + d) % n, bufs[d % 2][k], (r - d) % n) for k in range(2)
        ]
        return comm.start_exchange(pairs, tag=4)

    pending = start(1) if n > 1 else None
    for d in range(1, n):
        pending.wait()
        if d + 1 < n:
            pending = start(d + 1)
        for k in range(2):
            check(
                np.array_equal(bufs[d % 2][k], ring_array((r - d) % n, k * 100 + d)),
                f"start_exchange round {d} pair {k}",
            )
        res["exchange_sha"].append(sha(bufs[d % 2][0].tobytes() + bufs[d % 2][1].tobytes()))

    t0 = time.monotonic()
    comm.barrier()
    res["barrier_s"] = time.monotonic() - t0
    return res


def dup(comm: Any, out: Path) -> dict[str, Any]:
    """The main thread and a background thread both run allgathers and ring exchanges, with the
    same tags, on ``comm`` and ``comm.dup()``; each must only ever see its own traffic."""
    r, n = comm.rank, comm.size
    bg_comm = comm.dup()
    check(bg_comm is not comm and bg_comm.rank == r and bg_comm.size == n, "dup rank/size")
    errors: list[str] = []
    counts = {"main": 0, "bg": 0}
    spans: dict[str, list[float]] = {}

    def loop(c: Any, who: str, salt: int) -> None:
        spans[who] = [time.monotonic(), float("inf")]
        try:
            for i in range(DUP_ROUNDS):
                docs = c.allgather_json({"who": who, "i": i, "rank": r})
                check(
                    docs == [{"who": who, "i": i, "rank": j} for j in range(n)],
                    f"{who} allgather_json round {i}: {docs}",
                )
                blobs = c.allgather_bytes(payload(r, n, salt + i))
                check(
                    blobs == [payload(j, n, salt + i) for j in range(n)],
                    f"{who} allgather_bytes round {i}",
                )
                if i % 10 == 0:
                    got = np.zeros(RING_BYTES, np.uint8)
                    c.sendrecv(ring_array(r, salt + i), (r + 1) % n, got, (r - 1) % n, tag=0)
                    check(
                        np.array_equal(got, ring_array((r - 1) % n, salt + i)),
                        f"{who} ring round {i}",
                    )
                counts[who] += 1
        except Exception as exc:  # reported by the main thread, which then fails the rank
            errors.append(f"{who}: {type(exc).__name__}: {exc}")
        spans[who][1] = time.monotonic()

    thread = threading.Thread(target=loop, args=(bg_comm, "bg", 1000), daemon=True)
    thread.start()
    loop(comm, "main", 0)
    thread.join(90)
    check(not thread.is_alive(), "background thread did not finish")
    check(not errors, "; ".join(errors))
    comm.barrier()
    bg_comm.barrier()
    return {"rank": r, "size": n, "counts": counts, "spans": spans}


def background_abort(comm: Any, out: Path) -> dict[str, Any]:
    """Rank 1's background thread fails; the other ranks wait in a barrier that rank 1 never
    joins. Only the abort can end the job; reaching the end of this function is a failure."""
    from ckptfmt.transport.comm import start_background

    bg_comm = comm.dup()
    (out / f"rank{comm.rank}.started").write_text("")
    if comm.rank == 1:

        def fail() -> None:
            time.sleep(0.5)
            raise RuntimeError("injected failure in the background thread")

        start_background(bg_comm, fail, "inject")
        time.sleep(300)
    else:
        comm.barrier()
    raise CheckFailed("the job was not aborted")


def idle_wait(comm: Any, out: Path) -> dict[str, Any]:
    """Rank 0 sleeps ``IDLE_S`` before a barrier and a vote; the others wait in them. Each rank
    reports the CPU seconds its process used while waiting (the test checks that ``MpiComm``'s
    waits sleep rather than spin)."""
    comm.barrier()
    if comm.rank == 0:
        time.sleep(IDLE_S)
    t0, c0 = time.monotonic(), time.process_time()
    comm.barrier()
    comm.allgather_json({"rank": comm.rank})
    return {
        "rank": comm.rank,
        "size": comm.size,
        "wall_s": time.monotonic() - t0,
        "cpu_s": time.process_time() - c0,
    }


IDLE_S = 2.0

SCENARIOS = {
    "collectives": collectives,
    "dup": dup,
    "background_abort": background_abort,
    "idle_wait": idle_wait,
}


def main(argv: list[str]) -> int:
    """Run the comma-separated scenarios in order, in one job (one launch costs more than a
    scenario under torchrun)."""
    kind, scenarios, outdir = argv
    comm = make_comm(kind)
    for scenario in scenarios.split(","):
        out = Path(outdir) / scenario
        out.mkdir(parents=True, exist_ok=True)
        res = SCENARIOS[scenario](comm, out)
        (out / f"rank{comm.rank}.json").write_text(json.dumps(res))
    if kind == "torch":
        end_torch_job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
