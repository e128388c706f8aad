"""The private names of a deep-learning framework that an adapter depends on, checked on first use.

An adapter that must call a framework's private function (no public API does what it needs) keeps
every such name in one registry (:class:`PrivateNames`, in the adapter's ``_compat`` module). A
name is imported and checked the first time it is used, never when the adapter is imported, then
cached: a name that is missing, or a callable that lost a parameter the adapter passes it by
name, or an object whose behaviour probe fails, raises :class:`FrameworkCompatError` naming the
framework, its installed version, the name and the range the adapter supports, instead of a
feature silently switched off by a framework upgrade.

Framework-free: a framework is imported by its module's name at run time (``importlib``), only
when one of its names is asked for; this module imports none.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ckptfmt.errors import FrameworkCompatError

__all__ = ["Private", "PrivateNames"]


@dataclasses.dataclass(frozen=True)
class Private:
    """One private name of a framework: ``where`` is ``"module"`` or ``"module:Class"``,
    ``name`` the attribute there; ``params``: the parameters the adapter passes it by name
    (checked present in its signature); ``uses``: what the adapter does with it; ``check``: a
    probe of the behaviour the adapter relies on, given the object, that returns what is wrong
    (None: nothing); ``on_objects``: an attribute each object gets in ``__init__`` (the class
    has none), checked on the object at each use (:meth:`PrivateNames.attribute`)."""

    framework: str
    where: str
    name: str
    params: tuple[str, ...] = ()
    uses: str = ""
    check: Callable[[Any], str | None] | None = None
    on_objects: bool = False

    @property
    def qualname(self) -> str:
        """The name as the framework spells it: ``keras.Model._symbolic_build``."""
        return f"{self.where.replace(':', '.')}.{self.name}"


class PrivateNames(dict[str, Private]):
    """One adapter's private names by key, with ``supported``: framework (its distribution's
    name) -> the range of versions the adapter supports (its extras' bounds), and ``modules``:
    the module of a framework whose distribution is named otherwise
    (``{"pytorch-lightning": "pytorch_lightning"}``)."""

    def __init__(self, supported: Mapping[str, str], modules: Mapping[str, str]) -> None:
        super().__init__()
        self.supported = dict(supported)
        self.modules = dict(modules)
        self._found: dict[str, Any] = {}

    def installed_version(self, framework: str) -> str:
        """The installed version of ``framework`` (its ``__version__``), or
        ``"(not installed)"``."""
        try:
            module = importlib.import_module(self.modules.get(framework, framework))
        except ImportError:
            return "(not installed)"
        return str(getattr(module, "__version__", "(unknown version)"))

    def error(self, entry: Private, reason: str) -> FrameworkCompatError:
        """The error that says ``entry`` is not what the adapter expects, and why."""
        return FrameworkCompatError(
            entry.framework,
            self.installed_version(entry.framework),
            entry.qualname,
            self.supported[entry.framework],
            reason,
        )

    def resolve(self, entry: Private) -> Any:
        """The object ``entry`` names, imported and checked now (not cached: :meth:`checked`
        caches); for an ``on_objects`` entry, the class its objects are of."""
        module_name, _, owner = entry.where.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in owner.split(".") if owner else []:
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise self.error(entry, f"cannot be imported ({type(exc).__name__}: {exc})") from None
        if entry.on_objects:
            return obj  # the class: its objects are checked as they come (see attribute)
        if not hasattr(obj, entry.name):
            raise self.error(entry, "is missing")
        found = getattr(obj, entry.name)
        found = getattr(found, "ckptfmt_wraps", found)  # wrapped by us already: the original
        if entry.params:
            try:
                sig = inspect.signature(found)
            except (TypeError, ValueError):
                raise self.error(entry, "is no longer a callable with a signature") from None
            takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
            lost = [p for p in entry.params if p not in sig.parameters and not takes_any]
            if lost:
                raise self.error(
                    entry, f"has no parameter {', '.join(lost)} any more (it is {sig})"
                )
        problem = entry.check(found) if entry.check is not None else None
        if problem is not None:
            raise self.error(entry, problem)
        return found

    def checked(self, key: str) -> Any:
        """The object of entry ``key``, resolved and checked on first use, then cached."""
        if key not in self._found:
            self._found[key] = self.resolve(self[key])
        return self._found[key]

    def attribute(self, key: str, obj: Any) -> Any:
        """The attribute of the ``on_objects`` entry ``key`` on ``obj`` (one the framework
        sets in ``__init__``): :class:`FrameworkCompatError` when ``obj`` has none."""
        self.checked(key)
        entry = self[key]
        if not hasattr(obj, entry.name):
            raise self.error(entry, f"is missing on a {type(obj).__name__}")
        return getattr(obj, entry.name)
