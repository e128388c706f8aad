"""The usage family: the call itself is wrong (a bad argument, a state the format cannot hold, a
destination that exists, a state that does not match the checkpoint); nothing was written.

Every class is a :class:`UsageError`, also a ``ValueError`` (some a ``TypeError`` or
``FileExistsError`` too, where a caller may already catch those). The CLI exits with status 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptfmt.errors.base import CkptError, few


class UsageError(CkptError, ValueError):
    """The call itself is wrong (bad argument, unsupported value); nothing was written."""


class InvalidNameError(UsageError):
    """A tensor or value name breaks the name rules of the format (``spec/FORMAT.md``, "Names")."""

    def __init__(self, name: object, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"invalid name {name!r}: {reason}")


class UnsupportedValueError(UsageError, TypeError):
    """A state value is neither an array of a supported dtype nor a JSON-able value."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"cannot save {name!r}: {reason}")


class UnsupportedDtypeError(UsageError, TypeError):
    """An array's dtype is not one the format can hold (e.g. ``longdouble``, ``object``)."""

    def __init__(self, dtype: object, name: str | None = None) -> None:
        self.dtype = dtype
        self.name = name
        where = f" (tensor {name!r})" if name else ""
        super().__init__(f"unsupported dtype {dtype!s}{where}")


class LimitExceededError(UsageError):
    """A hard limit of the format (``spec/FORMAT.md``, "Limits") would be exceeded: ``what``
    is ``actual``, more than ``limit``."""

    def __init__(self, what: str, actual: object, limit: object) -> None:
        self.what = what
        self.actual = actual
        self.limit = limit
        super().__init__(f"{what} is {actual}, the limit is {limit}")


class DestinationExistsError(UsageError, FileExistsError):
    """The save target exists: a checkpoint (refused unless overwriting) or a foreign directory."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to save to {path}: {reason}")


class UrlNotSupportedError(UsageError):
    """A URL ckptfmt cannot use where it was given: a scheme that is no object store
    (``http://``, ``file://``), or a bucket's URL where only a directory on a file system works
    (level 1, a rebuild of level-1 copies). ``path``: what was given; ``scheme``: its scheme;
    ``needs``: what the place needs instead, when the scheme itself is supported elsewhere."""

    def __init__(self, path: str, scheme: str, needs: str | None = None) -> None:
        self.path = path
        self.scheme = scheme
        self.needs = needs
        if needs is None:
            text = (
                f"{path!r}: {scheme}:// URLs are not supported; give a file-system path or an "
                "object-store URL (s3://, gs://, az://)"
            )
        else:
            text = (
                f"{path!r}: {scheme}:// URLs are not supported here: {needs} (a bucket holds "
                "what ckptfmt.save, the collective save and the manager's level 3 write)"
            )
        super().__init__(text)


class CloudNotInstalledError(UsageError):
    """An object-store URL was given, but the library ckptfmt reaches object stores through
    (obstore, the ``cloud`` extra) is not installed. ``path``: the URL given."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"{path!r}: reading and writing object stores needs the cloud extra: "
            "pip install 'ckptfmt[cloud]'"
        )


class FrameworkCompatError(UsageError):
    """A private API of a deep-learning framework that an adapter relies on is missing or has
    changed in the installed version: the framework is outside the range the adapter supports
    (its extra's bounds in ``pyproject.toml``). Nothing was done with it.

    It is a usage error (the environment is wrong, the call never ran, and installing a
    supported version fixes it), deliberately not an ``ImportError``: a caller's
    ``except ImportError`` that treats a feature as optional must not swallow it.
    ``framework``: its name (``"torch"``, ``"keras"``); ``version``: the installed one;
    ``name``: the private name, as the framework spells it; ``supported``: the supported range
    (``">=2.4,<2.14"``); ``reason``: what is wrong with it (missing, a parameter gone)."""

    def __init__(
        self, framework: str, version: str, name: str, supported: str, reason: str
    ) -> None:
        self.framework = framework
        self.version = version
        self.name = name
        self.supported = supported
        self.reason = reason
        super().__init__(
            f"{framework} {version} is not supported by ckptfmt: {name} {reason}. ckptfmt "
            f"supports {framework}{supported}: install a version in that range (pip install "
            f"'{framework}{supported}'), or see docs/torch.md, \"Private framework APIs\""
        )


class PickleRefusedError(UsageError):
    """Reading ``path`` needs unpickling (DCP's ``.metadata`` is a pickle), which ckptfmt does
    only when asked explicitly (``trust_pickle=True``, ``--trust-pickle``); nothing was read."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to unpickle {path}: {reason}")


class ImplicitSingleProcessError(UsageError):
    """No ``comm`` was given but the launcher says the job has several ranks: every rank would
    save as "rank 0 of 1" into the same directories. ``world_size``: what the launcher says."""

    def __init__(self, world_size: int, launcher: str) -> None:
        self.world_size = world_size
        self.launcher = launcher
        super().__init__(
            f"{launcher} started {world_size} ranks but no comm was given: pass "
            "comm=ckptfmt.transport.mpi.MpiComm() (mpiexec/srun) or "
            "comm=ckptfmt_torch.comm.TorchComm() (torchrun), or run one process"
        )


class StateMismatchError(UsageError):
    """What is loaded into (a state, a model's variables) does not match what was saved (a
    checkpoint, named arrays); nothing was written into it.

    ``missing``: names of the destination that the source lacks; ``unexpected``: names in the
    source that the destination lacks; ``mismatched``: name -> (saved, destination), each
    described as ``"float32[16, 8]"`` (or the kind of value, where one side holds no array).
    ``into`` and ``source`` name the two sides in the message; ``hint`` says how to load part of
    the destination, shown when names are missing or unexpected; ``note``: what to do, shown
    always (a leftover backup of another model: which directory to remove); ``path`` and
    ``step``: the checkpoint loaded from, when the message should start with it."""

    def __init__(
        self,
        missing: Sequence[str],
        unexpected: Sequence[str],
        mismatched: Mapping[str, tuple[str, str]],
        *,
        into: str = "the state",
        source: str = "the checkpoint",
        hint: str = "",
        note: str = "",
        path: str | None = None,
        step: int | None = None,
    ) -> None:
        self.path = path
        self.step = step
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = dict(mismatched)
        pairs = list(self.mismatched.items())
        parts = [f"{n}: {d} in {into}, {s} in {source}" for n, (s, d) in pairs[:8]]
        if len(pairs) > 8:
            parts.append(f"... {len(pairs) - 8} more mismatches")
        if self.missing:
            parts.append(f"not in {source}: {few(self.missing)}")
        if self.unexpected:
            parts.append(f"not in {into}: {few(self.unexpected)}")
        if any(_shape_of(s) == _shape_of(d) != "" for s, d in self.mismatched.values()):
            parts.append(
                'dtypes differ: cast="safe" converts where no value changes, cast="any" anyway'
            )
        shown_hint = f" ({hint})" if hint and (self.missing or self.unexpected) else ""
        shown_note = f". {note}" if note else ""
        at = "" if step is None else f" (step {step})"
        where = f"{path}{at}: " if path is not None else ""
        super().__init__(
            f"{where}{into} does not match {source}, nothing was written into it: "
            + "; ".join(parts)
            + shown_hint
            + shown_note
        )


def _shape_of(described: str) -> str:
    """The ``[16, 8]`` of ``"float32[16, 8]"``; empty for a description without a shape."""
    return described[described.index("[") :] if "[" in described else ""


class DtypeMismatchError(UsageError, TypeError):
    """Saved tensors and the destinations they are loaded into differ in dtype, and the cast
    policy (``cast=``) does not allow converting them; nothing was written into any destination.

    ``mismatched``: name -> (saved dtype, destination dtype); ``cast``: the policy in force
    (``"no"``, ``"safe"``, ``"any"``)."""

    def __init__(self, mismatched: Mapping[str, tuple[str, str]], cast: str) -> None:
        self.mismatched = dict(mismatched)
        self.cast = cast
        shown = "; ".join(
            f"{n}: saved {s}, destination {d}" for n, (s, d) in list(self.mismatched.items())[:5]
        )
        more = f"; ... {len(self.mismatched) - 5} more" if len(self.mismatched) > 5 else ""
        hint = (
            'pass cast="safe" to convert where no value changes, cast="any" to convert anyway'
            if cast == "no"
            else 'not a safe cast: pass cast="any" to convert anyway (values may change)'
        )
        super().__init__(
            f"dtype mismatch for {len(self.mismatched)} tensor(s): {shown}{more} ({hint})"
        )


class PerRankError(UsageError):
    """Per-rank entries cannot be carried over to the current ranks as asked.

    ``entries``: their names; ``saved``, ``current``: the numbers of ranks that saved and that
    load; ``dropped``: saved ranks whose items would be lost; ``missing``: current ranks that
    would get none."""

    def __init__(
        self,
        entries: Sequence[str],
        saved: int,
        current: int,
        dropped: Sequence[int],
        missing: Sequence[int],
    ) -> None:
        self.entries = tuple(entries)
        self.saved, self.current = saved, current
        self.dropped, self.missing = tuple(dropped), tuple(missing)
        super().__init__(
            f"{describe_per_rank(entries, saved, current, dropped, missing)}; give a rank map "
            f"(saved rank -> current rank), or drop them explicitly"
        )


class DataPositionError(UsageError):
    """A saved data-loader position that this job cannot continue exactly: another dataset
    length, seed or order, a position past the epoch, or one that falls inside a global batch of
    this job when aligned batches were asked for. Never rounded: the job would repeat or skip
    samples. ``reason``: what differs; ``expected``/``actual``: this job's value and the
    saved one, where a single value differs."""

    def __init__(self, reason: str, *, expected: object = None, actual: object = None) -> None:
        self.reason = reason
        self.expected, self.actual = expected, actual
        super().__init__(f"cannot continue the saved data position: {reason}")


class StateChangedError(UsageError):
    """A tensor of a state being saved with its copy overlapping the training step changed in
    place before the copy was whole (a change the fence before the optimizer's update does not
    cover): the checkpoint of ``step`` could mix two states, so it is not committed; where the
    change is seen only after the commit, ``committed`` is True and the message says to delete
    it. ``names``: the tensors that changed."""

    def __init__(self, step: int, names: Sequence[str], *, committed: bool = False) -> None:
        self.step, self.names, self.committed = step, tuple(names), committed
        shown = ", ".join(self.names[:10]) + (
            f" (+{len(self.names) - 10} more)" if len(self.names) > 10 else ""
        )
        fate = (
            f"the checkpoint of step {step} was committed before this was seen and may mix two "
            f"states: delete it (CheckpointManager.delete({step}))"
            if committed
            else "it was not committed"
        )
        super().__init__(
            f"the state of step {step} changed in place before the optimizer step, while its "
            f"copy was being taken: {shown}; {fate}. Change saved tensors only in or after the "
            f"optimizer step (which waits for the copy), or save with the copy made before "
            f"save() returns"
        )


def describe_per_rank(
    entries: Sequence[str], saved: int, current: int, dropped: Sequence[int], missing: Sequence[int]
) -> str:
    """What is lost when per-rank ``entries`` of ``saved`` ranks are loaded by ``current``: the
    text of a :class:`PerRankError`, and of the warning when the caller chose to drop them."""
    shown = ", ".join(entries[:20]) + (f" (+{len(entries) - 20} more)" if len(entries) > 20 else "")
    parts = []
    if dropped:
        parts.append(f"the items of saved rank(s) {_ranks(dropped)} are not carried over")
    if missing:
        parts.append(f"current rank(s) {_ranks(missing)} get none")
    return (
        f"per-rank entries saved by {saved} ranks, loaded by {current}: {shown}: "
        + " and ".join(parts)
    )


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:32]))
    return shown + (f" (+{len(ranks) - 32} more)" if len(ranks) > 32 else "")
