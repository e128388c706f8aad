"""The roots of the tree: :class:`CkptError` for every error, :class:`CkptWarning` for every
warning, and the warnings themselves (they carry no family: a warning never ends a command)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any


class CkptError(Exception):
    """Base of every error ckptfmt raises on purpose.

    Every subclass belongs to one family (:data:`ckptfmt.errors.FAMILIES`), which decides the
    CLI's exit status. Fields name one idea each: ``path`` (the file or directory the error is
    about), ``level`` (the storage level, as ``"level 1 (local_dir)"``), ``rank``/``ranks``,
    ``step``, ``expected``/``actual``, ``tensors``, ``reason`` (what is wrong, in words)."""

    def __init__(self, *args: object) -> None:
        # Explicit so that a family root can call ``CkptError.__init__(self, message)`` by name
        # and still reach the built-in mix-in that follows CkptError in a subclass's MRO (a
        # diamond such as ManifestChecksumError would otherwise run one root's constructor twice).
        super().__init__(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its message and its fields, not through its constructor: a subclass's
        ``__init__`` takes its fields (``path``, ``reason``), not the message it made of them,
        so the default (``cls(*args)``) cannot rebuild it. ``torch.distributed.checkpoint``
        pickles a failed save's error on its coordinator and raises it on every rank; a
        multiprocessing pool does the same. A field that does not pickle (a live file, an
        exception of a foreign type) is left out: the message still names it."""
        fields = _picklable(self.__dict__)
        if isinstance(self, OSError):  # kept in the exception's slots, not its __dict__
            slots = {"errno": self.errno, "strerror": self.strerror}
            fields |= _picklable({k: v for k, v in slots.items() if v is not None})
        return (_unpickle, (type(self), self.args, fields))


def _picklable(fields: dict[str, Any]) -> dict[str, Any]:
    kept = {}
    for k, v in fields.items():
        try:
            pickle.dumps(v)
        except Exception:  # any failure to pickle drops the field, never the error
            continue
        kept[k] = v
    return kept


def _unpickle(cls: type[CkptError], args: tuple[Any, ...], fields: dict[str, Any]) -> CkptError:
    exc = _bare(cls)
    Exception.__init__(exc, *args)
    for k, v in fields.items():
        setattr(exc, k, v)
    return exc


def _bare(cls: type[CkptError]) -> CkptError:
    """An instance of ``cls`` with no constructor run. Python lets only the ``__new__`` of the
    built-in base that fixes the instance's layout (``OSError`` for a ``FileExistsError``
    mix-in, ``BaseException`` for ``MemoryError``) make it: each built-in base is tried in turn."""
    for base in cls.__mro__:
        if base.__module__ != "builtins" or base is object:
            continue
        try:
            return base.__new__(cls)  # type: ignore[no-any-return, call-overload]
        except TypeError:  # "X.__new__(cls) is not safe": another base owns the layout
            continue
    raise TypeError(f"{cls.__name__} cannot be unpickled")  # unreachable for an Exception


class CkptWarning(UserWarning):
    """Base of every warning ckptfmt gives: something was done differently from what was asked,
    or done with a loss the caller allowed, and the program goes on."""


class CastWarning(CkptWarning):
    """A load converted some tensors to their destinations' dtypes, as ``cast=`` allowed it.
    ``casts``: every conversion, by tensor (:class:`ckptfmt.tree.casting.Conversion`)."""

    def __init__(self, casts: Iterable[Any]) -> None:
        self.casts: tuple[Any, ...] = tuple(casts)
        shown = "; ".join(str(c) for c in self.casts[:8])
        more = f"; ... {len(self.casts) - 8} more" if len(self.casts) > 8 else ""
        super().__init__(f"ckptfmt: cast {len(self.casts)} tensor(s) on load: {shown}{more}")


class PerRankWarning(CkptWarning):
    """Per-rank entries were dropped because the caller asked for it (``unmapped="drop"``)."""


class CheckpointWarning(CkptWarning):
    """A background save failed; training goes on with the previous checkpoints intact."""


class FlushWarning(CheckpointWarning):
    """The flush of a step to level 3 failed (a full or unreachable shared level); the step is
    committed on level 1 and the save it follows did not fail. The manager tries again at its
    next save. ``step``: the step; ``error``: why the flush failed."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step = step
        self.error = error
        super().__init__(
            f"step {step} is saved on level 1, but its flush to level 3 failed (tried again "
            f"at the next save): {error}"
        )


class ReplicaWarning(CkptWarning):
    """Replicas that should be identical differ (non-trainable state such as BatchNormalization
    statistics, which each worker updates from its own batches); rank 0's values were taken."""


class ResumeWarning(CkptWarning):
    """A resume goes on, but it cannot give what the interrupted run would have (a framework
    that carries its data iterator across epochs, where the resumed run starts it afresh)."""


def ranks_text(ranks: Sequence[int], most: int = 8) -> str:
    """``"rank 3"`` or ``"ranks 0, 1, 2 and 5 more"``: ranks named in a message."""
    shown = ", ".join(map(str, ranks[:most]))
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def few(names: Sequence[str], most: int = 8) -> str:
    """Names in a message: the first ``most``, then how many more."""
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
