"""Every private API of PyTorch, DCP, Lightning and transformers that this adapter uses, in one
place: the one module to read and update when a framework is upgraded (docs/torch.md,
"Private framework APIs").

Each private name is an entry of :data:`PRIVATE` (a :class:`Private`: the framework, where the
name lives, the parameters the adapter passes it). It is imported and checked the first time it
is used, never when the adapter is imported (importing ``ckptfmt_torch`` stays cheap), then
cached: a name that is missing, or a callable that lost a parameter the adapter passes, raises
:class:`ckptfmt.errors.FrameworkCompatError` naming the framework, its installed version, the
name and the supported range, instead of a feature silently switched off.
``tests/adapters/torch/test_torch_compat.py`` resolves every entry against the installed frameworks.

The supported ranges (:data:`SUPPORTED`) are the upper bounds of the extras in
``pyproject.toml`` (a test keeps the two equal): each excludes the minor release after the
newest one the entries were checked against (torch 2.13, Lightning 2.6, transformers 5.25),
since a private name may change in any release.

Where a public API does the same in every supported version, it is used instead, outside this
module (``torch.distributed.tensor.DTensor`` and its placements, public since torch 2.4).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ckptfmt.frameworks import Private, PrivateNames

SUPPORTED: dict[str, str] = {
    "torch": ">=2.4,<2.14",
    "pytorch-lightning": ">=2.6,<2.7",
    "lightning": ">=2.6,<2.7",  # the unified package, where it stands in for the standalone one
    "transformers": ">=5,<5.26",
}
"""framework (its distribution's name) -> the range this adapter supports (the extras' bounds)."""

PRIVATE = PrivateNames(SUPPORTED, {"pytorch-lightning": "pytorch_lightning"})
"""Every private name this adapter uses, by key (``ckptfmt.frameworks``)."""


# what the rest of the adapter calls: the object of an entry, checked on first use (``private``),
# the check itself (``resolve``), and the error that names a framework's version and range
private = PRIVATE.checked
resolve = PRIVATE.resolve
installed_version = PRIVATE.installed_version
_error = PRIVATE.error


def _add(key: str, entry: Private) -> None:
    PRIVATE[key] = entry


# --- torch / DTensor ------------------------------------------------------------------------------

_add(
    "dtensor.local_shape_and_offset",
    Private(
        "torch",
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        ("global_shape", "mesh", "placements"),
        "where this rank's shard of a DTensor lies in the global tensor (no public API says)",
    ),
)


def local_shape_and_offset(
    global_shape: Any, mesh: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offset)`` of this rank's shard of a tensor of ``global_shape``
    placed on ``mesh`` by ``placements``."""
    fn = private("dtensor.local_shape_and_offset")
    shape, offset = fn(global_shape, mesh, placements)
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset)


def _tags_metadata(state_dict: Any) -> str | None:
    """``Module.state_dict`` still tags its dict with ``_metadata`` (``{prefix: {"version":
    n}}``), which ``load_state_dict`` hands to each module's ``_load_from_state_dict``."""
    import torch

    meta = getattr(state_dict(torch.nn.Linear(1, 1)), "_metadata", None)
    if isinstance(meta, Mapping) and "version" in meta.get("", {}):
        return None
    return f"no longer tags its dict with _metadata of module versions (found {meta!r})"


_add(
    "state_dict.metadata",
    Private(
        "torch",
        "torch.nn:Module",
        "state_dict",
        ("destination", "prefix", "keep_vars"),
        "the private _metadata (module versions) of a state dict, which load_state_dict "
        "reads: kept through a Lightning checkpoint",
        check=_tags_metadata,
    ),
)


def state_dict_metadata(mapping: Any) -> Any:
    """The ``_metadata`` of a PyTorch state dict (``None`` for a dict without one)."""
    private("state_dict.metadata")
    return getattr(mapping, "_metadata", None)


def set_state_dict_metadata(mapping: Any, metadata: Any) -> None:
    """Give a state dict (an ``OrderedDict``) its ``_metadata`` back, as ``state_dict()`` made
    it."""
    private("state_dict.metadata")
    mapping._metadata = metadata


# --- DCP (torch.distributed.checkpoint) -----------------------------------------------------------

_add(
    "dcp.load_state_dict",
    Private(
        "torch",
        "torch.distributed.checkpoint.state_dict_loader",
        "_load_state_dict",
        ("state_dict", "storage_reader", "planner", "no_dist"),
        "a DCP checkpoint read whole into an empty dict (dcp.load copies the dict first, so "
        "what the planner adds is lost; DCP's own dcp_to_torch_save calls this)",
    ),
)
_add(
    "dcp.empty_state_dict_planner",
    Private(
        "torch",
        "torch.distributed.checkpoint.default_planner",
        "_EmptyStateDictLoadPlanner",
        (),
        "the load planner that builds the state dict from the checkpoint's metadata",
    ),
)


def dcp_read_whole(path: Any) -> dict[str, Any]:
    """The whole state dict of the DCP checkpoint directory ``path``, read in this process
    with no process group (as DCP's ``dcp_to_torch_save`` reads it). DCP's reader unpickles
    ``.metadata``: the caller decides whether that is trusted."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    load_state_dict = private("dcp.load_state_dict")
    planner_class = private("dcp.empty_state_dict_planner")
    sd: dict[str, Any] = {}
    load_state_dict(
        sd, storage_reader=FileSystemReader(path), planner=planner_class(), no_dist=True
    )
    return sd


# --- Lightning ------------------------------------------------------------------------------------

LIGHTNING_LOADERS = {
    "pytorch-lightning": ("pytorch_lightning.core.saving", "lightning_fabric.plugins.io.torch_io"),
    "lightning": ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io"),
}
"""The modules (of the standalone packages, and of the unified ``lightning`` package) whose
file loader ``pl_load`` (Lightning's private ``cloud_io._load``, imported under that name)
``load_from_checkpoint`` and ``TorchCheckpointIO`` call."""

for _framework, _modules in LIGHTNING_LOADERS.items():
    for _module in _modules:
        _add(
            f"lightning.pl_load:{_module}",
            Private(
                _framework,
                _module,
                "pl_load",
                ("path_or_url", "map_location", "weights_only"),
                "wrapped so that Lightning's own loaders read a ckptfmt checkpoint directory",
            ),
        )


def wrap_lightning_loader(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``pl_load`` in each imported Lightning loader module with ``wrap(pl_load)``
    (once: a function ``wrap`` returned carries ``ckptfmt_wraps``). Every loader module of
    each Lightning package that is imported must have it, with the parameters the wrapper
    passes on (checked first: :class:`FrameworkCompatError` otherwise, nothing replaced)."""
    targets: list[ModuleType] = []
    for modules in LIGHTNING_LOADERS.values():
        if modules[0] in sys.modules:  # that package is in use: its loaders must be wrappable
            for module_name in modules:
                private(f"lightning.pl_load:{module_name}")
                targets.append(sys.modules[module_name])
    for module in targets:
        current = module.__dict__["pl_load"]
        if not hasattr(current, "ckptfmt_wraps"):
            setattr(module, "pl_load", wrap(current))  # noqa: B010 - mypy sees no such attribute


# --- transformers ---------------------------------------------------------------------------------

TRAINER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_scaler": ("checkpoint",),
    "_load_rng_state": ("checkpoint",),
    "_load_best_model": (),
    "_init_training_state": (
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
}
"""The private ``transformers.Trainer`` methods ``ckptfmt_torch.hf.CheckpointMixin`` overrides
(by name, as a subclass does), with the parameters HF passes them. Should HF rename one, the
override would silently never run: :func:`check_trainer` refuses such a version first."""

for _name, _params in TRAINER_OVERRIDES.items():
    _add(
        f"transformers.Trainer.{_name}",
        Private("transformers", "transformers:Trainer", _name, _params, "overridden"),
    )
_add(
    "transformers.Trainer._get_output_dir",
    Private("transformers", "transformers:Trainer", "_get_output_dir", ("trial",), "run dir"),
)
_add(
    "transformers.Trainer._push_from_checkpoint",
    Private(
        "transformers",
        "transformers:Trainer",
        "_push_from_checkpoint",
        ("checkpoint_folder",),
        "push_to_hub after a save",
    ),
)
_add(
    "transformers.ExportableState",
    Private(
        "transformers",
        "transformers.trainer_callback",
        "ExportableState",
        (),
        "the stateful callbacks whose state trainer_state.json holds",
    ),
)
TRAINER_STATE_FIELDS = ("best_global_step", "best_model_checkpoint", "stateful_callbacks")
"""``TrainerState`` fields the rewritten ``_save_checkpoint`` reads and sets as HF's does."""


@functools.cache
def check_trainer() -> None:
    """Every private ``Trainer`` name ``CheckpointMixin`` overrides or calls, and the
    ``TrainerState`` fields it uses, are there as the mixin expects (once, at the first
    trainer made): :class:`FrameworkCompatError` otherwise."""
    for key in PRIVATE:
        if key.startswith("transformers."):
            private(key)
    import transformers

    fields = getattr(transformers.TrainerState, "__dataclass_fields__", {})
    for name in TRAINER_STATE_FIELDS:
        if name not in fields:
            entry = Private("transformers", "transformers:TrainerState", name)
            raise _error(entry, "is missing")


def trainer_output_dir(trainer: Any, trial: Any) -> str:
    """HF's run directory for ``trial`` (``output_dir``, or a trial's own under a search)."""
    private("transformers.Trainer._get_output_dir")  # checked; called bound: a subclass's own
    return str(trainer._get_output_dir(trial=trial))


def trainer_push(trainer: Any, checkpoint: str) -> None:
    """HF's ``push_to_hub`` of the checkpoint directory just saved."""
    private("transformers.Trainer._push_from_checkpoint")
    trainer._push_from_checkpoint(checkpoint)


def exportable_state() -> Any:
    """HF's base class of callbacks whose state ``trainer_state.json`` carries."""
    return private("transformers.ExportableState")
