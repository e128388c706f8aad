"""``CheckpointManager.restore(state, into=True)``: the load reads straight into the caller's
arrays (each tensor written once on the way in, no second copy), for whole tensors,
``Shard`` boxes of a job of another size (threads as ranks) and bfloat16; arrays that cannot
take their tensor as it is (a strided view, another dtype) are loaded and copied as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kit.managers import make_manager

import ckptfmt
from ckptfmt import CheckpointManager, Shard, WriteOptions
from ckptfmt.errors import (
    DtypeMismatchError,
    PickleRefusedError,
    StateMismatchError,
    UnrecoverableDamageError,
)
from ckptfmt.transport import ThreadComm, run_threads


def _saved(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": rng.standard_normal((64, 32)).astype(np.float32),
            "h": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16),
            "b": np.arange(32.0),
        },
        "step": step,
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {
            "w": np.zeros((64, 32), np.float32),
            "h": np.zeros((16, 16), ml_dtypes.bfloat16),
            "b": np.zeros(32),
        },
        "step": 0,
    }


def _mgr(tmp_path: Path, **kw: Any) -> CheckpointManager:
    return make_manager(tmp_path, shared=None, **kw)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def test_into_reads_straight_into_the_callers_arrays(tmp_path: Path) -> None:
    saved = _saved(4)
    with _mgr(tmp_path) as mgr:
        mgr.save(4, saved)
    state = _blank()
    dests = {k: state["model"][k] for k in ("w", "h", "b")}
    with _mgr(tmp_path) as mgr:
        report = mgr.restore(state, into=True)
        assert report.step == 4 and report.state is not None
        for k, dest in dests.items():
            assert state["model"][k] is dest  # updated in place
            assert _bits(dest) == _bits(saved["model"][k])  # bit-exact, bfloat16 included
            assert report.state["model"][k] is dest  # the load's own array: one write
        assert state["step"] == 4


def test_without_into_the_load_has_arrays_of_its_own(tmp_path: Path) -> None:
    saved = _saved(5)
    with _mgr(tmp_path) as mgr:
        mgr.save(5, saved)
    state = _blank()
    with _mgr(tmp_path) as mgr:
        report = mgr.restore(state)
        assert report.step == 5 and report.state is not None
        w = state["model"]["w"]
        assert _bits(w) == _bits(saved["model"]["w"])
        assert not np.shares_memory(report.state["model"]["w"], w)


def test_arrays_that_cannot_take_the_tensor_are_loaded_and_copied(tmp_path: Path) -> None:
    saved = _saved(6)
    with _mgr(tmp_path) as mgr:
        mgr.save(6, saved)
    state = _blank()
    strided = np.zeros((32, 64), np.float32).T  # the saved shape, not C-contiguous
    state["model"]["w"] = strided
    state["model"]["b"] = np.zeros(32, np.float32)  # another dtype: needs cast
    with _mgr(tmp_path) as mgr:
        with pytest.raises(DtypeMismatchError):
            mgr.restore(state, into=True)  # the cast policy still refuses
        with pytest.warns(UserWarning, match="cast 1 tensor"):
            report = mgr.restore(state, into=True, cast="any")
        assert report.step == 6 and report.state is not None
        assert state["model"]["w"] is strided
        assert _bits(strided) == _bits(saved["model"]["w"])
        assert not np.shares_memory(report.state["model"]["w"], strided)
        assert np.array_equal(state["model"]["b"], saved["model"]["b"].astype(np.float32))


def test_shard_boxes_of_another_job_size_are_read_into_place(tmp_path: Path) -> None:
    """Saved by one rank, restored by 2 thread ranks, each into its own row block."""
    saved = _saved(7)
    with _mgr(tmp_path) as mgr:
        mgr.save(7, saved)
    full = saved["model"]["w"]

    def body(comm: ThreadComm) -> tuple[bool, bytes]:
        rows = slice(32 * comm.rank, 32 * (comm.rank + 1))
        mine = np.zeros((32, 32), np.float32)
        state = {"model": {"w": Shard(mine, (32 * comm.rank, 0), full.shape)}}
        with CheckpointManager(
            local_dir=tmp_path / "l1",
            write=WriteOptions(fsync=False),
            comm=comm,
            node="n0",
            async_save=False,
        ) as mgr:
            report = mgr.restore(state, into=True, strict=False)
            assert report.step == 7 and report.state is not None
            same = report.state["model"]["w"] is mine
        return same, _bits(mine) + _bits(full[rows])

    for same, both in run_threads(2, body):
        assert same
        half = len(both) // 2
        assert both[:half] == both[half:]


def test_into_leaves_excluded_arrays_alone(tmp_path: Path) -> None:
    """A partial restore reads straight into the arrays it restores, never into one left out
    (before, ``into=True`` landed every array whose shape and dtype fitted, excluded or not)."""
    saved = _saved(8)
    with _mgr(tmp_path) as mgr:
        mgr.save(8, saved)
    state = _blank()
    with _mgr(tmp_path) as mgr:
        report = mgr.restore(state, into=True, exclude=["model/h"])
    assert report.applied is not None and report.applied.excluded == ["model/h"]
    assert _bits(state["model"]["w"]) == _bits(saved["model"]["w"])
    assert not state["model"]["h"].any()  # left as it was


@pytest.mark.parametrize("extra", ["a name the checkpoint lacks", "another shape"])
def test_into_writes_nothing_into_a_state_that_does_not_match(tmp_path: Path, extra: str) -> None:
    """A state that ``restore`` refuses is refused before anything is read into it, with
    ``into=True`` as without."""
    saved = _saved(9)
    with _mgr(tmp_path) as mgr:
        mgr.save(9, saved)
    state = _blank()
    if extra == "another shape":
        state["model"]["b"] = np.zeros(31)
    else:
        state["model"]["x"] = np.zeros(3, np.float32)
    with _mgr(tmp_path) as mgr, pytest.raises(StateMismatchError):
        mgr.restore(state, into=True)
    assert not state["model"]["w"].any() and not state["model"]["h"].any()
    assert state["step"] == 0


class _Opaque:
    """An object a save can only store pickled."""


@pytest.mark.parametrize("trust", [False, True])
def test_into_writes_nothing_when_a_list_holds_a_pickled_object(
    tmp_path: Path, trust: bool
) -> None:
    """A pickled object inside a list is found before anything is read into the state, as one
    at the top of it: without ``trust_pickle`` the restore refuses it with every array as it
    was (before, the arrays were read into first, then the refusal raised); with it, what the
    object unpickles to is not known before it is read, so nothing is landed (loaded and
    copied instead)."""
    saved = _saved(10)
    saved["objs"] = [_Opaque(), 3]
    with _mgr(tmp_path) as mgr:
        mgr.save(10, saved, objects="pickle")
    state = _blank()
    state["objs"] = [None, 0]
    w = state["model"]["w"]
    with _mgr(tmp_path) as mgr:
        if not trust:
            with pytest.raises(PickleRefusedError, match="objs/0"):
                mgr.restore(state, into=True)
            assert not w.any() and not state["model"]["h"].any() and not state["model"]["b"].any()
            assert state["step"] == 0
            return
        report = mgr.restore(state, into=True, trust_pickle=True)
    assert report.state is not None and report.state["model"]["w"] is not w  # read, then copied
    assert _bits(w) == _bits(saved["model"]["w"])
    assert isinstance(state["objs"][0], _Opaque) and state["objs"][1] == 3


@pytest.mark.parametrize("into", [False, True])
def test_numpy_scalars_of_the_state_are_restored(tmp_path: Path, into: bool) -> None:
    """A numpy scalar in the state (``np.float64(0.5)``, a bfloat16 one) is saved as a 0-d
    tensor; restoring into the same kind of state replaces it (a numpy scalar cannot be
    written into) by a scalar of its dtype holding the saved bits, and refuses another dtype
    unless ``cast`` allows it."""
    saved = {"lr": np.float64(0.1) / 3, "scale": ml_dtypes.bfloat16(1.5), "n": np.int32(-7)}
    with _mgr(tmp_path) as mgr:
        mgr.save(1, saved)
    state: dict[str, Any] = {"lr": np.float64(0), "scale": ml_dtypes.bfloat16(0), "n": np.int32(0)}
    with _mgr(tmp_path) as mgr:
        assert mgr.restore(state, into=into).step == 1
        for k, v in saved.items():
            assert type(state[k]) is type(v) and state[k].tobytes() == v.tobytes(), k
        wrong = {"lr": np.float32(0), "scale": ml_dtypes.bfloat16(0), "n": np.int32(0)}
        with pytest.raises(DtypeMismatchError, match="lr"):
            mgr.restore(wrong, into=into)
        assert wrong["lr"] == 0
        mgr.restore(wrong, into=into, cast="any")
        assert type(wrong["lr"]) is np.float32 and wrong["lr"] == np.float32(saved["lr"])


def test_a_saved_value_replaces_a_numpy_scalar_of_the_state(tmp_path: Path) -> None:
    """A value saved as JSON (a Python float) restored into a state holding a numpy scalar
    replaces it, as any value does."""
    with _mgr(tmp_path) as mgr:
        mgr.save(1, {"lr": 0.25, "w": np.ones(3, np.float32)})
    state: dict[str, Any] = {"lr": np.float64(0), "w": np.zeros(3, np.float32)}
    with _mgr(tmp_path) as mgr:
        assert mgr.restore(state).step == 1
    assert state["lr"] == 0.25 and np.array_equal(state["w"], np.ones(3, np.float32))


def _flip_last_chunk(root: Path, tensor: str) -> None:
    """Flip a bit in the last data file of ``tensor`` (so that its other files land first)."""
    files = sorted((root / tensor / "c").rglob("*"), key=lambda p: p.parts)
    last = [p for p in files if p.is_file()][-1]
    data = bytearray(last.read_bytes())
    data[10] ^= 0x04
    last.write_bytes(bytes(data))


def test_into_that_found_every_copy_damaged_says_the_state_was_written(tmp_path: Path) -> None:
    """Every copy damaged: without ``into`` the restore restores nothing and the state is
    untouched; with ``into`` part of the damaged step already landed in the state's arrays, so
    the restore does not say "nothing restored" (a caller would then train from that state):
    it raises, naming the step and what to do. With an older whole step, ``into`` falls back
    to it and every array holds it bit for bit."""
    write = WriteOptions(fsync=False, chunk_bytes=1 << 10, shard_bytes=1 << 12)
    big = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)}
    with _mgr(tmp_path, write=write) as mgr:
        mgr.save(2, big)
    _flip_last_chunk(tmp_path / "l1" / "step-0000000002", "w")

    state = {"w": np.full((64, 32), -1, np.float32)}
    with _mgr(tmp_path, write=write) as mgr, pytest.warns(ckptfmt.CheckpointWarning):
        assert mgr.restore(state).step is None
    assert (state["w"] == -1).all()
    with (
        _mgr(tmp_path, write=write) as mgr,
        pytest.raises(UnrecoverableDamageError, match=r"into=True.*step 2") as info,
    ):
        mgr.restore(state, into=True)
    assert "step-0000000002" in str(info.value)
    assert not (state["w"] == -1).all()  # what the error is about: the state was written

    older = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)[::-1].copy()}
    with _mgr(tmp_path / "b", write=write) as mgr:
        mgr.save(1, older)
        mgr.save(2, big)
    _flip_last_chunk(tmp_path / "b" / "l1" / "step-0000000002", "w")
    state = {"w": np.full((64, 32), -1, np.float32)}
    with _mgr(tmp_path / "b", write=write) as mgr, pytest.warns(ckptfmt.CheckpointWarning):
        assert mgr.restore(state, into=True).step == 1
    assert _bits(state["w"]) == _bits(older["w"])
