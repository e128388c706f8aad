"""One shape per verb across ``ckptfmt``, ``ckptfmt_torch`` and ``ckptfmt_keras``: the thing
saved or loaded into first, then where; the same keyword for the same idea (``write``, ``read``,
``cast``, ``progress``); what each verb returns. Then what the shared vocabulary does: the
``{node}`` templates ``load`` and ``open`` take, ``Manifest.values``, the one progress type of
``verify`` and ``export``, the ``Cast`` policy's refusal of anything else."""

from __future__ import annotations

import inspect
import shutil
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.managers import NO_EXIT_HOOKS, NO_FSYNC

import ckptfmt
from ckptfmt import CheckpointManager, Progress, WriteOptions
from ckptfmt.errors import StateMismatchError, UsageError
from ckptfmt.interop import export_safetensors
from ckptfmt.maintenance import rebuild, reshard
from ckptfmt.manifest import Manifest
from ckptfmt.transport.threads import run_threads
from ckptfmt.tree import Cast, check_policy

NODES = ("n0", "n1")


def params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def positional(fn: Callable[..., Any]) -> list[str]:
    return [
        n for n, p in params(fn).items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def keyword_only(fn: Callable[..., Any], *names: str) -> None:
    ps = params(fn)
    for n in names:
        assert n in ps, f"{fn.__qualname__} has no {n}="
        assert ps[n].kind is inspect.Parameter.KEYWORD_ONLY, f"{fn.__qualname__}: {n} positional"


def returns(fn: Callable[..., Any]) -> Any:
    return typing.get_type_hints(fn)["return"]


LOOSE = {"fsync", "chunk_bytes", "shard_bytes", "overwrite", "rank_map", "per_rank", "on_plan"}


# --- the core ------------------------------------------------------------------------------------


def test_core_verbs() -> None:
    assert positional(ckptfmt.save) == ["state", "path"]
    keyword_only(ckptfmt.save, "step", "write", "progress", "objects")
    assert returns(ckptfmt.save) is Manifest
    assert positional(ckptfmt.load) == ["path"]
    keyword_only(ckptfmt.load, "read", "max_bytes", "progress", "trust_pickle")
    assert positional(ckptfmt.open) == ["path"]
    assert positional(ckptfmt.verify) == ["path"]
    keyword_only(ckptfmt.verify, "progress")
    assert returns(ckptfmt.latest) == ckptfmt.StepRef | None
    for fn in (ckptfmt.save, ckptfmt.load, ckptfmt.verify, export_safetensors, rebuild, reshard):
        assert not LOOSE & set(params(fn)), fn.__qualname__


def test_every_writer_takes_write_and_every_progress_is_one_type() -> None:
    from ckptfmt.interop import import_named, import_safetensors

    for fn in (ckptfmt.save, export_safetensors, import_safetensors, import_named, rebuild):
        keyword_only(fn, "write", "progress")
        hints = typing.get_type_hints(fn)
        assert hints["write"] == WriteOptions | None, fn.__qualname__
        assert hints["progress"] == ckptfmt.ProgressCallback | None, fn.__qualname__
    assert typing.get_type_hints(reshard)["progress"] == ckptfmt.ProgressCallback | None


def test_cast_is_one_literal() -> None:
    assert ckptfmt.Cast is Cast
    assert typing.get_args(Cast) == ("no", "safe", "any")
    for good in ("no", "safe", "any"):
        assert check_policy(good) == good
    for bad in (None, "yes", "", "NO", 1, True):
        with pytest.raises(UsageError, match="cast must be one of"):
            check_policy(bad)


def test_step_ref_unpacks(tmp_path: Path) -> None:
    ckptfmt.save({"a": np.arange(3)}, tmp_path / "step-7", step=7, write=NO_FSYNC)
    ref = ckptfmt.latest(tmp_path)
    assert isinstance(ref, ckptfmt.StepRef)
    assert ref.step == 7 and ref.path == tmp_path / "step-7"
    step, path = ref
    assert (step, path) == (7, tmp_path / "step-7")
    assert ckptfmt.latest(tmp_path / "none") is None


def test_overwrite_lives_in_write_options(tmp_path: Path) -> None:
    ckptfmt.save({"a": 1}, tmp_path / "c", write=NO_FSYNC)
    with pytest.raises(ckptfmt.CkptError):
        ckptfmt.save({"a": 2}, tmp_path / "c", write=NO_FSYNC)
    ckptfmt.save({"a": 2}, tmp_path / "c", write=WriteOptions(fsync=False, overwrite=True))
    assert ckptfmt.load(tmp_path / "c") == {"a": 2}
    with pytest.raises(TypeError):
        ckptfmt.save({"a": 3}, tmp_path / "c", overwrite=True)  # type: ignore[call-arg]
    with pytest.raises(UsageError, match="WriteOptions"):
        ckptfmt.save({"a": 3}, tmp_path / "d", write={"fsync": False})  # type: ignore[arg-type]


# --- Manifest.values -----------------------------------------------------------------------------


def test_manifest_values_by_prefix(tmp_path: Path) -> None:
    state = {
        "w": np.zeros(2),
        "counters": {"epoch": 3, "step": 7, "inner": {"x": [1, 2]}},
        "note": "hi",
    }
    m = ckptfmt.save(state, tmp_path / "c", write=NO_FSYNC)
    assert m.values("counters") == {"epoch": 3, "step": 7, "inner/x": [1, 2]}
    assert m.values("counters/") == m.values("counters")
    assert m.values("counters/inner") == {"x": [1, 2]}
    assert m.values() == {"counters/epoch": 3, "counters/step": 7, "counters/inner/x": [1, 2],
                          "note": "hi"}  # fmt: skip
    assert m.values("w") == {} and m.values("nothing") == {}


# --- {node} templates in load and open -----------------------------------------------------------


def node_state(rank: int) -> dict[str, Any]:
    rows = np.arange(40, dtype=np.float32).reshape(8, 5) + 100 * rank
    return {
        "w": ckptfmt.Shard(rows[rank * 4 : rank * 4 + 4].copy(), (rank * 4, 0), (8, 5)),
        "shared": np.arange(6, dtype=np.int16),
        "bias": np.full(3, 0.5, np.float32),
        "counters": {"step": 5},
    }


def want_w() -> np.ndarray:
    out = np.empty((8, 5), np.float32)
    for r in range(2):
        out[r * 4 : r * 4 + 4] = (np.arange(40, dtype=np.float32).reshape(8, 5) + 100 * r)[
            r * 4 : r * 4 + 4
        ]
    return out


@pytest.fixture(scope="module")
def level1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A level-1 checkpoint of two ranks on two simulated nodes, saved by the manager with xor
    redundancy across them (no level 3): ``root/l1/<node>/step-0000000005``."""
    root = tmp_path_factory.mktemp("l1")

    def rank(comm: Any) -> None:
        mgr = CheckpointManager(
            local_dir=root / "l1" / "{node}",
            comm=comm,
            node=NODES[comm.rank],
            redundancy={"scheme": "xor", "set_size": 2},
            async_save=False,
            write=NO_FSYNC,
            at_exit=NO_EXIT_HOOKS,
        )
        try:
            mgr.save(5, node_state(comm.rank))
            mgr.wait()
        finally:
            mgr.close(flush=False)

    run_threads(2, rank)
    return root


def template(root: Path) -> str:
    return str(root / "l1" / "{node}" / "step-0000000005")


def copy_of(level1: Path, tmp_path: Path) -> Path:
    shutil.copytree(level1 / "l1", tmp_path / "l1")
    return tmp_path


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def check_loaded(got: dict[str, Any]) -> None:
    assert got["w"].tobytes() == want_w().tobytes() and got["w"].dtype == np.float32
    assert got["shared"].tobytes() == np.arange(6, dtype=np.int16).tobytes()
    assert got["bias"].tobytes() == np.full(3, 0.5, np.float32).tobytes()
    assert got["counters"] == {"step": 5}


def test_load_and_open_a_node_template(level1: Path, tmp_path: Path) -> None:
    root = copy_of(level1, tmp_path)
    before = tree(root)
    check_loaded(ckptfmt.load(template(root)))
    dirs = {n: root / "l1" / n / "step-0000000005" for n in NODES}
    check_loaded(ckptfmt.load(dirs))
    view = ckptfmt.open(template(root))
    assert view.step == 5
    assert view["w"][2:6, 1:3].tobytes() == want_w()[2:6, 1:3].tobytes()
    assert np.asarray(view["w"]).tobytes() == want_w().tobytes()
    assert view["counters/step"] == 5
    assert tree(root) == before  # only read


def test_load_a_node_template_with_a_node_lost(level1: Path, tmp_path: Path) -> None:
    """A node's directory gone: its part is rebuilt from the other's parity into scratch space,
    bit for bit, and the source is left as it was (the lost node stays lost)."""
    for lost in NODES:
        root = copy_of(level1, tmp_path / lost)
        shutil.rmtree(root / "l1" / lost)
        before = tree(root)
        seen: list[Progress] = []
        check_loaded(ckptfmt.load(template(root), progress=seen.append))
        assert seen and seen[-1].final and seen[-1].op == "load"
        view = ckptfmt.open(template(root))
        assert np.asarray(view["w"]).tobytes() == want_w().tobytes()
        del view
        assert tree(root) == before
        assert not (root / "l1" / lost).exists()


def test_load_a_node_template_with_a_flipped_byte(level1: Path, tmp_path: Path) -> None:
    """Damage a CRC only finds when the data is read: the load rebuilds and reads again."""
    root = copy_of(level1, tmp_path)
    shard = next(
        p for p in sorted((root / "l1" / "n1").rglob("*")) if "/w/c/" in str(p) and p.is_file()
    )
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    before = tree(root)
    check_loaded(ckptfmt.load(template(root)))
    assert tree(root) == before


def test_load_own_takes_this_ranks_items(tmp_path: Path) -> None:
    from ckptfmt.checkpoint import load_own
    from ckptfmt.errors import PerRankError, PerRankWarning

    def rank(comm: Any) -> None:
        from ckptfmt.parallel import save_collective

        state = {"rng": ckptfmt.PerRank(np.full(2, comm.rank, np.uint8)), "v": 1}
        save_collective(comm, state, tmp_path / "c", step=None, node="n0", write=NO_FSYNC)

    run_threads(2, rank)
    assert ckptfmt.load(tmp_path / "c")["rng"].shape == (2, 2)  # as saved: every rank's row
    with pytest.raises(PerRankError):
        load_own(tmp_path / "c")
    with pytest.warns(PerRankWarning):
        got, m = load_own(
            tmp_path / "c", read=ckptfmt.ReadOptions(rank_map={1: 0}, per_rank="drop")
        )
    assert got["rng"].tolist() == [1, 1] and got["v"] == 1 and m.world_size == 2


# --- one progress type for verify and export -----------------------------------------------------


def test_verify_and_export_report_progress_events(level1: Path, tmp_path: Path) -> None:
    root = copy_of(level1, tmp_path)
    for spec in (template(root), root / "l1" / "n0" / "step-0000000005"):
        seen: list[Progress] = []
        report = ckptfmt.verify(spec, progress=seen.append)
        assert seen, spec
        assert {p.op for p in seen} == {"verify"}
        assert seen[-1].final and seen[-1].done == seen[-1].total
        assert all(a.done <= b.done for a, b in zip(seen, seen[1:]))  # noqa: RUF007
        if report.healthy:
            assert seen[-1].done == report.bytes_checked
    seen = []
    report = export_safetensors(
        template(root), tmp_path / "hf", strip="", write=NO_FSYNC, progress=seen.append
    )
    assert {p.op for p in seen} == {"export"} and seen[-1].final
    assert seen[-1].done == seen[-1].total == report.total_size


def test_a_progress_callback_that_raises_does_not_stop_verify(tmp_path: Path) -> None:
    ckptfmt.save({"a": np.arange(1000)}, tmp_path / "c", write=NO_FSYNC)

    def boom(p: Progress) -> None:
        raise RuntimeError("a bar that broke")

    assert ckptfmt.verify(tmp_path / "c", progress=boom).healthy


def test_import_reports_progress(tmp_path: Path) -> None:
    from ckptfmt.interop import import_named

    items = [("a.weight", np.arange(4096, dtype=np.float32)), ("b", np.ones(7, np.int8))]
    seen: list[Progress] = []
    import_named(items, tmp_path / "one", source="mem", fmt="test", write=NO_FSYNC,
                 progress=seen.append)  # fmt: skip
    assert {p.op for p in seen} == {"import"} and seen[-1].final
    seen = []
    import_named(items, str(tmp_path / "{node}" / "two"), source="mem", fmt="test",
                 write=NO_FSYNC, ranks=2, nodes=["n0", "n1"], progress=seen.append)  # fmt: skip
    assert {p.op for p in seen} == {"import"} and seen[-1].final
    assert seen[-1].done == seen[-1].total
    assert all(a.done <= b.done for a, b in zip(seen, seen[1:]))  # noqa: RUF007


# --- the adapters --------------------------------------------------------------------------------


def read_and_cast_hints(fn: Callable[..., Any]) -> None:
    """``read`` and ``cast`` mean the core's ideas wherever they appear."""
    hints = typing.get_type_hints(fn)
    if "read" in hints:
        assert hints["read"] == ckptfmt.ReadOptions | None, fn.__qualname__
    if "cast" in hints:
        assert hints["cast"] == Cast, fn.__qualname__
    if "write" in hints:
        assert hints["write"] == WriteOptions | None, fn.__qualname__
    if "progress" in hints:
        assert hints["progress"] == ckptfmt.ProgressCallback | None, fn.__qualname__
    assert not LOOSE & set(hints), fn.__qualname__


def test_torch_verbs() -> None:
    pytest.importorskip("torch")
    import ckptfmt_torch as ct
    from ckptfmt_torch import staging

    assert positional(ct.save) == ["state_dict", "path"]
    keyword_only(ct.save, "step", "write", "progress", "comm", "node", "objects")
    assert returns(ct.save) is Manifest
    assert positional(ct.load) == ["state_dict", "path"]
    keyword_only(ct.load, "read", "cast", "into", "progress", "comm", "trust_pickle")
    assert returns(ct.load) is Manifest
    assert positional(ct.restore) == ["state_dict", "manager"]
    keyword_only(ct.restore, "read", "cast", "into", "map_location", "trust_pickle")
    keyword_only(ct.to_state, "objects")
    assert returns(ct.restore) is ckptfmt.RestoreReport
    for fn in (ct.save, ct.load, ct.restore):
        read_and_cast_hints(fn)
    assert not hasattr(staging, "restore")  # one restore: ckptfmt_torch.restore


def test_keras_verbs() -> None:
    pytest.importorskip("keras")
    import ckptfmt_keras as ck

    assert positional(ck.save) == ["model", "path"]
    keyword_only(ck.save, "optimizer", "counters", "step", "write", "progress")
    assert positional(ck.load) == ["model", "path"]
    keyword_only(ck.load, "optimizer", "strict", "cast", "progress")
    assert positional(ck.restore) == ["model", "manager"]
    keyword_only(ck.restore, "optimizer", "metrics", "strict", "cast", "read")
    assert returns(ck.restore) is ckptfmt.RestoreReport
    assert positional(ck.save_variables) == ["obj", "path"]
    keyword_only(ck.save_variables, "step", "write", "progress")
    assert positional(ck.load_variables) == ["obj", "path"]
    keyword_only(ck.load_variables, "strict", "name_map", "transform", "cast")
    for fn in (ck.save, ck.load, ck.save_variables):
        assert returns(fn) is Manifest, fn.__qualname__
    assert positional(ck.to_state) == ["model"]
    assert positional(ck.from_state) == ["model", "state"]
    keyword_only(ck.from_state, "optimizer", "metrics", "strict", "cast")
    for fn in (ck.save, ck.load, ck.restore, ck.save_variables, ck.load_variables, ck.from_state):
        read_and_cast_hints(fn)


def test_the_manager_restore_shape() -> None:
    assert positional(CheckpointManager.restore) == ["self", "state"]
    keyword_only(CheckpointManager.restore, "read", "strict", "include", "exclude", "cast", "into")
    keyword_only(CheckpointManager.restore, "trust_pickle")
    keyword_only(CheckpointManager.save, "objects")
    assert returns(CheckpointManager.restore) is ckptfmt.RestoreReport
    read_and_cast_hints(CheckpointManager.restore)


def one_process_manager(root: Path) -> CheckpointManager:
    return CheckpointManager(
        local_dir=root / "l1" / "{node}",
        shared_dir=root / "l3",
        node="n0",
        write=NO_FSYNC,
        at_exit=NO_EXIT_HOOKS,
    )


def test_torch_restore_puts_what_only_the_checkpoint_has_on_map_location(tmp_path: Path) -> None:
    """The tensors the state dict has are loaded into in place; the ones only the checkpoint
    has are added on ``map_location``; a manager with nothing saved leaves the state as it is."""
    torch = pytest.importorskip("torch")
    import ckptfmt_torch as ct

    w = torch.arange(6.0).reshape(2, 3)
    extra = torch.arange(5).to(torch.bfloat16)
    with one_process_manager(tmp_path / "empty") as mgr:
        target: dict[str, Any] = {"w": torch.zeros(2, 3), "opt": {}, "step": 0}
        keep = target["w"]
        report = ct.restore(target, mgr, map_location="cpu")
        assert not report.restored and report.step is None and report.state is None
        assert target == {"w": keep, "opt": {}, "step": 0} and not keep.any()
    with one_process_manager(tmp_path) as mgr:
        mgr.save(3, ct.to_state({"w": w, "opt": {"extra": extra}, "step": 3}))
    with one_process_manager(tmp_path) as mgr:
        report = ct.restore(target, mgr, map_location="cpu")
    assert isinstance(report, ckptfmt.RestoreReport)
    assert report.restored and report.step == 3 and report.state is not None
    assert target["w"] is keep and torch.equal(keep, w)
    added = target["opt"]["extra"]
    assert isinstance(added, torch.Tensor) and added.device.type == "cpu"
    assert added.dtype == torch.bfloat16
    assert added.view(torch.int16).tolist() == extra.view(torch.int16).tolist()
    assert target["step"] == 3


def test_keras_restore_through_a_manager(tmp_path: Path) -> None:
    """A model and its optimizer saved through a manager come back bit-exact into a model built
    the same way, all or nothing; the counters are in ``report.state``."""
    keras = pytest.importorskip("keras")
    import ckptfmt_keras as ck

    def model(seed: int, width: int = 4) -> Any:
        keras.utils.set_random_seed(seed)
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width), keras.layers.Dense(2)])
        m.compile(keras.optimizers.Adam(1e-2), "mse")
        return m

    def values(variables: Any) -> list[bytes]:
        return [np.asarray(v.numpy()).tobytes() for v in variables]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    trained = model(0)
    trained.fit(x, y, epochs=2, batch_size=4, verbose=0)  # moments and iterations not zero
    counters = {"epoch": 2, "step": 0, "global_step": 8}
    with one_process_manager(tmp_path) as mgr:
        assert not ck.restore(model(2), mgr).restored  # nothing saved yet
        mgr.save(8, ck.to_state(trained, counters=counters))

    other = model(1, width=3)  # another shape: refused before any variable changes
    before = values(other.weights)
    with one_process_manager(tmp_path) as mgr, pytest.raises(StateMismatchError):
        ck.restore(other, mgr)
    assert values(other.weights) == before

    fresh = model(1)
    assert values(fresh.weights) != values(trained.weights)
    with one_process_manager(tmp_path) as mgr:
        report = ck.restore(fresh, mgr)
    assert isinstance(report, ckptfmt.RestoreReport) and report.step == 8
    assert report.state is not None and report.state["counters"] == counters
    assert values(fresh.weights) == values(trained.weights)
    assert values(fresh.optimizer.variables) == values(trained.optimizer.variables)
    assert int(fresh.optimizer.iterations.numpy()) == 8
