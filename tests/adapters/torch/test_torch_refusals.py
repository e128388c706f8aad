"""What a new PyTorch user hits: a load that fails leaves every destination as it
was, bit for bit; a dtype mismatch is refused unless ``cast=`` allows it, and every conversion is
reported; URLs are refused; a ``TrainingState`` loads a checkpoint whose per-rank state was
dropped, with fresh RNG streams and a warning naming what was missing."""

from __future__ import annotations

import os
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from kit.faults import flip

torch = pytest.importorskip("torch")

import ckptfmt_torch  # noqa: E402
from ckptfmt_torch import TrainingState  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import WriteOptions  # noqa: E402
from ckptfmt.errors import (  # noqa: E402
    CastWarning,
    CkptError,
    DtypeMismatchError,
    LoadFailedError,
    MetadataMismatchError,
    UnsupportedValueError,
    UrlNotSupportedError,
    UsageError,
)

pytestmark = pytest.mark.torch


def raw(t: Any) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def snapshot(obj: Any) -> dict[str, bytes]:
    """Every tensor of a module/optimizer state (or a dict of tensors) as bytes."""
    sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
    out: dict[str, bytes] = {}

    def walk(x: Any, p: str) -> None:
        if isinstance(x, torch.Tensor):
            out[p] = raw(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{p}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{p}/{i}")
        else:
            out[p] = repr(x).encode()

    walk(sd, "")
    return out


def test_failed_load_leaves_every_destination_untouched(tmp_path: Path) -> None:
    ckptfmt_torch.save({"a": torch.arange(6.0), "b": torch.ones(3, 4)}, tmp_path / "c")
    a = torch.full((6,), -1.5)
    b = torch.zeros(4, 3)  # the wrong shape
    before = raw(a)
    with pytest.raises(UsageError, match=r"b: the checkpoint holds shape \[3, 4\]"):
        ckptfmt_torch.load({"a": a, "b": b}, tmp_path / "c")
    assert raw(a) == before  # `a` comes first and was not written


def test_failed_load_names_every_problem_at_once(tmp_path: Path) -> None:
    ckptfmt_torch.save({"a": torch.ones(2), "b": torch.ones(3)}, tmp_path / "c")
    a, b, c = torch.zeros(5), torch.zeros(3, dtype=torch.float64), torch.zeros(1)
    with pytest.raises(UsageError) as exc:
        ckptfmt_torch.load({"a": a, "b": b, "c": c}, tmp_path / "c")
    text = str(exc.value)
    assert "a: the checkpoint holds shape [2]" in text and "no entry 'c'" in text, text
    assert raw(a) == raw(torch.zeros(5)) and raw(b) == raw(torch.zeros(3, dtype=torch.float64))


def test_module_and_optimizer_untouched_when_a_later_entry_fails(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckptfmt_torch.save({"model": model, "optim": opt, "w": torch.ones(2)}, tmp_path / "c")
    torch.manual_seed(1)
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    model2(torch.randn(2, 4)).sum().backward()
    opt2.step()
    m_before, o_before = snapshot(model2), snapshot(opt2)
    with pytest.raises(UsageError, match="w: the checkpoint holds shape"):
        ckptfmt_torch.load({"model": model2, "optim": opt2, "w": torch.ones(7)}, tmp_path / "c")
    assert snapshot(model2) == m_before and snapshot(opt2) == o_before


def test_module_with_fewer_parameters_refused_before_any_copy(tmp_path: Path) -> None:
    """The checkpoint has a parameter the module lacks: ``load_state_dict(strict=True)`` would
    refuse it after the other parameters were already copied in."""
    big = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ckptfmt_torch.save({"model": big}, tmp_path / "c")
    small = torch.nn.Sequential(torch.nn.Linear(3, 3))
    before = snapshot(small)
    with pytest.raises(UsageError, match=r"model/1\.weight"):
        ckptfmt_torch.load({"model": small}, tmp_path / "c")
    assert snapshot(small) == before


def test_optimizer_groups_mismatch_refused_before_the_model_is_written(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    ckptfmt_torch.save({"model": model, "optim": opt}, tmp_path / "c")
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)  # one group, not two
    before = snapshot(model2)
    with pytest.raises(UsageError, match="parameter groups"):
        ckptfmt_torch.load({"model": model2, "optim": opt2}, tmp_path / "c")
    assert snapshot(model2) == before


def test_dtype_mismatch_refused_by_default(tmp_path: Path) -> None:
    saved = torch.linspace(-3, 3, 7, dtype=torch.float32) / 3
    ckptfmt_torch.save({"w": saved, "v": torch.ones(2)}, tmp_path / "c")
    v = torch.zeros(2)
    w = torch.zeros(7, dtype=torch.bfloat16)
    before = raw(w), raw(v)
    with pytest.raises(DtypeMismatchError) as exc:
        ckptfmt_torch.load({"v": v, "w": w}, tmp_path / "c")
    assert exc.value.mismatched == {"w": ("float32", "bfloat16")}
    assert 'cast="safe"' in str(exc.value)
    assert (raw(w), raw(v)) == before
    # float32 -> bfloat16 rounds: not a safe cast either
    with pytest.raises(DtypeMismatchError, match='cast="any"'):
        ckptfmt_torch.load({"v": v, "w": w}, tmp_path / "c", cast="safe")
    assert (raw(w), raw(v)) == before
    with pytest.warns(CastWarning) as rec:
        ckptfmt_torch.load({"v": v, "w": w}, tmp_path / "c", cast="any")
    assert [str(c) for c in rec[0].message.casts] == ["w: float32 -> bfloat16"]  # type: ignore[union-attr]
    assert raw(w) == raw(saved.to(torch.bfloat16)) and raw(v) == raw(torch.ones(2))


def test_safe_cast_is_exact_and_reported(tmp_path: Path) -> None:
    saved = (torch.randn(64) * 100).to(torch.bfloat16)
    ckptfmt_torch.save({"w": saved}, tmp_path / "c")
    w = torch.zeros(64, dtype=torch.float32)
    with pytest.raises(DtypeMismatchError):
        ckptfmt_torch.load({"w": w}, tmp_path / "c")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ckptfmt_torch.load({"w": w}, tmp_path / "c", cast="safe")
    casts = [c for r in rec if isinstance(r.message, CastWarning) for c in r.message.casts]
    assert [(c.name, c.saved, c.target) for c in casts] == [("w", "bfloat16", "float32")]
    assert torch.equal(w.to(torch.bfloat16), saved)  # every value exact


def test_equal_dtypes_load_without_a_warning(tmp_path: Path) -> None:
    ckptfmt_torch.save({"w": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "c")
    w = torch.zeros(3, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptfmt_torch.load({"w": w}, tmp_path / "c")
    assert raw(w) == raw(torch.ones(3, dtype=torch.bfloat16))


def test_a_bad_cast_policy_is_a_usage_error(tmp_path: Path) -> None:
    ckptfmt_torch.save({"w": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(UsageError, match="cast must be one of"):
        ckptfmt_torch.load({"w": torch.ones(3)}, tmp_path / "c", cast="yes")


def test_optimizer_state_of_another_dtype_refused(tmp_path: Path) -> None:
    """torch's ``Optimizer.load_state_dict`` casts state to the parameter's dtype: refused
    unless asked, like a parameter."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    ckptfmt_torch.save({"optim": opt}, tmp_path / "c")
    model2 = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt2 = torch.optim.Adam(model2.parameters())
    with pytest.raises(DtypeMismatchError, match="exp_avg"):
        ckptfmt_torch.load({"optim": opt2}, tmp_path / "c")
    assert not opt2.state
    with pytest.warns(CastWarning):
        ckptfmt_torch.load({"optim": opt2}, tmp_path / "c", cast="any")
    assert opt2.state


def test_manager_restore_is_all_or_nothing(tmp_path: Path) -> None:
    mgr = ckptfmt.CheckpointManager(local_dir=tmp_path / "l1")
    mgr.save(3, ckptfmt_torch.to_state({"a": torch.arange(4.0), "b": torch.ones(2)}))
    mgr.close()
    a = torch.full((4,), 9.0)
    b = torch.zeros(2, dtype=torch.float16)
    before = raw(a), raw(b)
    mgr = ckptfmt.CheckpointManager(local_dir=tmp_path / "l1")
    try:
        with pytest.raises(DtypeMismatchError):
            ckptfmt_torch.restore({"a": a, "b": b}, mgr)
        assert (raw(a), raw(b)) == before  # the manager never wrote into the tensors either
        with pytest.warns(CastWarning):
            assert ckptfmt_torch.restore({"a": a, "b": b}, mgr, cast="any").step == 3
        assert raw(a) == raw(torch.arange(4.0)) and raw(b) == raw(
            torch.ones(2, dtype=torch.float16)
        )
    finally:
        mgr.close()


def test_torch_objects_given_to_the_manager_are_raised_at_the_call(tmp_path: Path) -> None:
    """A module, an optimizer or a ``TrainingState`` passed to ``mgr.save`` without
    ``to_state`` is misuse: raised at the call under ``on_error="warn"`` too (it used to only
    warn, and training went on with no checkpoint), nothing staged; the next save works."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = ckptfmt.CheckpointManager(
        local_dir=tmp_path / "l1", write=WriteOptions(fsync=False), on_error="warn"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning instead of the error
            for bad in ({"model": model}, {"optim": opt}, {"train": TrainingState(model, opt)}):
                with pytest.raises(UnsupportedValueError, match=next(iter(bad))):
                    mgr.save(1, bad)
        assert mgr.failed_saves == [] and mgr.latest() is None
        mgr.save(2, ckptfmt_torch.to_state({"model": model, "optim": opt}))
        mgr.wait()
        assert mgr.latest().step == 2
    finally:
        mgr.close(flush=False)


def _peak(fn: Any) -> int:
    """The most memory numpy/Python allocated while ``fn`` ran (tracemalloc's peak)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _two_layers(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    model[1].to(torch.bfloat16)
    return model


@pytest.mark.parametrize("api", ["restore", "load"])
def test_into_reads_straight_into_the_tensors(tmp_path: Path, api: str) -> None:
    """``into=True``: each CPU tensor is read into once, in its own memory (the same storage,
    bit-exact, bfloat16 included), with no second copy of the state in memory; the default
    loads into buffers first (all or nothing) and so allocates the state's size."""
    model = _two_layers(0)
    want = {k: raw(v) for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    write = WriteOptions(fsync=False)
    mgr = ckptfmt.CheckpointManager(local_dir=tmp_path / "l1", write=write)
    mgr.save(3, ckptfmt_torch.to_state({"model": model.state_dict(), "step": 3}))
    mgr.close()
    path = tmp_path / "l1" / "step-0000000003"
    peaks = {}
    for into in (False, True):
        fresh = _two_layers(1)  # other weights
        assert {k: raw(v) for k, v in fresh.state_dict().items()} != want
        ptrs = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
        sd = {"model": fresh, "step": 0}
        if api == "restore":
            mgr = ckptfmt.CheckpointManager(local_dir=tmp_path / "l1", write=write)
            try:
                peaks[into] = _peak(lambda m=mgr, d=sd, i=into: ckptfmt_torch.restore(d, m, into=i))
            finally:
                mgr.close(flush=False)
        else:
            peaks[into] = _peak(lambda d=sd, i=into: ckptfmt_torch.load(d, path, into=i))
        assert {k: raw(v) for k, v in fresh.state_dict().items()} == want
        assert {k: v.data_ptr() for k, v in fresh.state_dict().items()} == ptrs
        assert sd["step"] == 3
    assert peaks[False] >= nbytes, peaks  # the buffers the default loads into
    assert peaks[True] < nbytes / 4, (peaks, nbytes)  # no second copy of the state


def test_into_finds_a_damaged_zarr_json_beside_the_reads(tmp_path: Path) -> None:
    """With ``into=True`` the ``zarr.json`` documents are checked on the read threads, beside
    the data (the caller accepted that a failed load may have written): a damaged one is
    still damage, named, and the load raises."""
    model = _two_layers(0)
    path = tmp_path / "ckpt"
    ckptfmt_torch.save({"model": model}, path, write=WriteOptions(fsync=False))
    doc = path / "model" / "1.weight" / "zarr.json"
    doc.write_bytes(doc.read_bytes().replace(b'"bfloat16"', b'"bfloat17"'))
    for into in (False, True):
        with pytest.raises(LoadFailedError) as info:
            ckptfmt_torch.load({"model": _two_layers(1)}, path, into=into)
        assert isinstance(info.value.cause, MetadataMismatchError), repr(info.value.cause)
        assert "model/1.weight/zarr.json" in str(info.value), str(info.value)


@pytest.mark.parametrize("url", ["file:///tmp/x", "http://host/ckpt/step-1"])
def test_urls_are_refused(tmp_path: Path, url: str) -> None:
    """URLs of schemes that are no object store (``s3://`` and the like: tests/objects)."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(UrlNotSupportedError, match="URLs are not supported"):
            ckptfmt_torch.save({"a": torch.ones(2)}, url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt_torch.load({"a": torch.ones(2)}, url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt.save({"a": np.ones(2)}, url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt.load(url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt.open(url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt.latest(url)
        with pytest.raises(UrlNotSupportedError):
            ckptfmt.verify(url)
        assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/x made
    finally:
        os.chdir(cwd)


def test_training_state_loads_without_per_rank_state(tmp_path: Path) -> None:
    """A checkpoint whose per-rank state (RNG streams, sampler position) was dropped loads into
    a ``TrainingState``: the model and counters are restored, the RNG streams start fresh (as
    the program seeded them), and a warning names what was missing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ts = TrainingState(model, counters={"step": 5})
    sd = ts.state_dict()
    no_rng = {k: v for k, v in sd.items() if k != "rng"}
    ckptfmt.save(ckptfmt_torch.to_state({"train": no_rng}), tmp_path / "c")
    torch.manual_seed(1)
    model2 = torch.nn.Linear(3, 2)
    ts2 = TrainingState(model2)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state().clone()
    with pytest.warns(UserWarning, match=r"'rng'.*fresh") as rec:
        ckptfmt_torch.load({"train": ts2}, tmp_path / "c")
    assert any("rng" in str(r.message) for r in rec)
    assert ts2.counters == {"step": 5}
    assert raw(model2.weight) == raw(model.weight)
    assert torch.equal(torch.get_rng_state(), rng_before)  # left as the program seeded it


def test_training_state_still_requires_what_is_not_per_rank(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    sd = TrainingState(model).state_dict()
    ckptfmt.save(
        ckptfmt_torch.to_state({"train": {"rng": sd["rng"], "counters": {}}}), tmp_path / "c"
    )
    model2 = torch.nn.Linear(3, 2)
    before = snapshot(model2)
    with pytest.raises(UsageError, match="no entry 'train/model"):
        ckptfmt_torch.load({"train": TrainingState(model2)}, tmp_path / "c")
    assert snapshot(model2) == before


def test_ml_dtypes_view_safe_cast_table() -> None:
    from ckptfmt.tree.casting import is_safe

    bf16, f8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
    assert is_safe(bf16, np.dtype(np.float32)) and not is_safe(np.dtype(np.float32), bf16)
    assert is_safe(f8, np.dtype(np.float16)) and is_safe(f8, bf16)
    assert not is_safe(np.dtype(np.float16), bf16) and not is_safe(bf16, np.dtype(np.float16))
    assert is_safe(np.dtype(np.int16), np.dtype(np.int32))
    assert not is_safe(np.dtype(np.float32), np.dtype(np.int64))


def test_training_state_loads_a_reshard_that_dropped_per_rank_state(tmp_path: Path) -> None:
    """The issue's path: a save, ``ckptfmt reshard --drop-per-rank`` to another size (every
    rank's RNG state left out; the sampler's position is global and kept), then a load into a
    ``TrainingState``."""
    from ckptfmt_torch import ResumableSampler

    from ckptfmt.maintenance.reshard import reshard

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sampler = ResumableSampler(10, shuffle=True, seed=1)
    sampler.seek(0, 4)  # 4 samples of epoch 0 consumed
    ts = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    ts.counters["step"] = 7
    ckptfmt_torch.save({"train": ts}, tmp_path / "src", step=7)
    read = ckptfmt.ReadOptions(rank_map="identity", per_rank="drop")
    rep = reshard(tmp_path / "src", tmp_path / "dst", 2, read=read)
    assert rep.warning is not None and "left out for all 2 new rank(s)" in rep.warning
    assert "train/rng/torch" in rep.dropped and "train/data" not in rep.dropped, rep.dropped
    model2 = torch.nn.Linear(3, 2)
    ts2 = TrainingState(
        model2,
        torch.optim.SGD(model2.parameters(), lr=0.1),
        sampler=ResumableSampler(10, shuffle=True, seed=1),
    )
    with pytest.warns(UserWarning, match=r"no per-rank 'rng'") as caught:
        assert ckptfmt_torch.load({"train": ts2}, tmp_path / "dst").step == 7
    assert not any("'data'" in str(w.message) for w in caught)
    assert (ts2.sampler.epoch, ts2.sampler.consumed) == (0, 4)
    assert ts2.counters == {"step": 7}
    assert raw(model2.weight) == raw(model.weight) and raw(model2.bias) == raw(model.bias)


@pytest.mark.parametrize("damaged", ["a", "b"])
def test_damage_found_by_a_load_leaves_every_destination_untouched(
    tmp_path: Path, damaged: str
) -> None:
    """The default load checks every chunk's CRC before it writes a byte into a tensor: the
    damage of either tensor, found after the other was read whole, leaves both as they were."""
    ckptfmt_torch.save({"a": torch.arange(6.0), "b": torch.ones(3, 4)}, tmp_path / "c")
    (shard,) = [f for f in (tmp_path / "c" / damaged / "c").rglob("*") if f.is_file()]
    flip(shard)  # a byte of its first chunk's payload
    a, b = torch.full((6,), -1.5), torch.full((3, 4), 7.0)
    before = (raw(a), raw(b))
    with pytest.raises(CkptError, match=r"checksum|CRC"):
        ckptfmt_torch.load({"a": a, "b": b}, tmp_path / "c", read=ckptfmt.ReadOptions(threads=1))
    assert (raw(a), raw(b)) == before
