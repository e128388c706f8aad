"""``TrainingState``: everything a training loop needs back after a restart, as one stateful
object; ``rng_state`` / ``set_rng_state`` for the random generators of each rank."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ckptfmt.errors import UsageError
from ckptfmt.tree import PerRank

_PY_WORDS = 625  # random.getstate()[1]: 624 Mersenne Twister words and the position


def _own(v: Any) -> Any:
    return v.value if isinstance(v, PerRank) else v


def _array(v: Any, dtype: Any) -> np.ndarray:
    """A per-rank array as loaded (numpy, or a tensor when loaded into a plain dict), copied."""
    v = _own(v)
    if isinstance(v, torch.Tensor):
        v = v.numpy()
    return np.array(v, dtype=dtype)


def rng_state() -> dict[str, Any]:
    """This rank's random generators as ``PerRank`` leaves (each rank saves and gets back its
    own): torch's CPU generator, every CUDA device's when CUDA is available, numpy's global
    generator (``np.random.*``) and Python's ``random``. Generators a program makes itself
    (``np.random.default_rng``, ``torch.Generator``) are its own state to save."""
    np_state = np.random.get_state(legacy=False)
    version, words, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": PerRank(torch.get_rng_state().numpy()),
        "numpy": {
            "key": PerRank(np.asarray(np_state["state"]["key"], dtype=np.uint32)),
            "meta": PerRank(
                {
                    "bit_generator": np_state["bit_generator"],
                    "pos": int(np_state["state"]["pos"]),
                    "has_gauss": int(np_state["has_gauss"]),
                    "gauss": float(np_state["gauss"]),
                }
            ),
        },
        "python": {
            "words": PerRank(np.asarray(words, dtype=np.uint32)),
            "meta": PerRank({"version": version, "gauss_next": gauss_next}),
        },
    }
    if torch.cuda.is_available():
        out["cuda"] = PerRank(torch.stack(torch.cuda.get_rng_state_all()).numpy())
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set this rank's generators from what :func:`rng_state` gave (``PerRank`` leaves or their
    loaded values)."""
    torch.set_rng_state(torch.from_numpy(_array(state["torch"], np.uint8)))
    meta = _own(state["numpy"]["meta"])
    np.random.set_state(
        {
            "bit_generator": meta["bit_generator"],
            "state": {"key": _array(state["numpy"]["key"], np.uint32), "pos": meta["pos"]},
            "has_gauss": meta["has_gauss"],
            "gauss": meta["gauss"],
        }
    )
    words = _array(state["python"]["words"], np.uint32)
    py = _own(state["python"]["meta"])
    if words.shape != (_PY_WORDS,):
        raise UsageError(f"Python random state of shape {list(words.shape)}, not [{_PY_WORDS}]")
    random.setstate((py["version"], tuple(int(w) for w in words), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = torch.from_numpy(_array(state["cuda"], np.uint8))
        torch.cuda.set_rng_state_all(list(cuda.unbind(0)))


class TrainingState:
    """The state of a training job as one stateful object (``state_dict`` /
    ``load_state_dict``), for ``ckptfmt_torch.save``/``load`` or a ``CheckpointManager``.

    ``state_dict()`` holds:

    - ``model`` and ``optim``: from ``torch.distributed.checkpoint.state_dict.get_state_dict``,
      so parameters and optimizer state are keyed by parameter name for plain modules, DDP (the
      ``module.`` prefix removed) and FSDP2 (DTensor shards) alike; loaded back with
      ``set_state_dict``. Collective under FSDP2.
    - ``scheduler`` and ``scaler`` (an LR scheduler, a ``GradScaler``), when given;
    - ``counters``: a dict of JSON values the loop keeps (``ts.counters["step"] = step``);
    - ``rng``: this rank's generators (:func:`rng_state`), when ``rng`` is true;
    - ``data``: the sampler's position: ``ResumableSampler``'s is global (the same on every
      rank, loadable at another world size); another sampler's state is saved per rank;
    - ``extra``: further statefuls or values, by name.

    A checkpoint without ``rng`` or ``data`` (per-rank state left out by ``ckptfmt reshard
    --drop-per-rank`` or a load with ``per_rank="drop"``) still loads: the generators and the
    sampler keep the state this process gave them (fresh streams), with a warning naming what
    was missing (``ckptfmt_optional`` tells ``ckptfmt_torch.load`` that they may be absent).
    """

    ckptfmt_optional = ("rng", "data")

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        sampler: Any = None,
        rng: bool = True,
        counters: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if optimizer is not None and model is None:
            raise UsageError("an optimizer needs its model (its state is keyed by parameter name)")
        self.model = model
        if optimizer is None:
            self.optimizers: list[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = [optimizer]
        else:
            self.optimizers = list(optimizer)
        self.scheduler, self.scaler, self.sampler = scheduler, scaler, sampler
        self.rng = rng
        self.counters: dict[str, Any] = dict(counters or {})
        self.extra: dict[str, Any] = dict(extra or {})

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        if self.model is not None:
            fresh = [o for o in self.optimizers if not o.state]
            # imported here, not with ckptfmt_torch: it loads torch.distributed.tensor (a
            # second or more), which only a TrainingState's state needs
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
            for o in fresh:  # get_state_dict initialised it with a zero step: undo, so that a
                o.state.clear()  # fresh run trains exactly as it would without a checkpoint
            sd["model"] = model_sd
            if self.optimizers:
                sd["optim"] = optim_sd
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        sd["counters"] = dict(self.counters)
        if self.rng:
            sd["rng"] = rng_state()
        if self.sampler is not None:
            data = self.sampler.state_dict()
            # a global position (ResumableSampler's) is the same on every rank: saved once, it
            # loads at any world size; another sampler's state is this rank's own
            sd["data"] = data if data.get("kind") == "global" else PerRank(data)
        if self.extra:
            sd["extra"] = dict(self.extra)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.model is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict  # see state_dict

            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict.get("optim", {}),
            )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        self.counters = dict(state_dict["counters"])
        missing = []
        if self.rng:
            if "rng" in state_dict:
                set_rng_state(state_dict["rng"])
            else:
                missing.append("'rng' (this rank's RNG streams: they start fresh, as seeded here)")
        if self.sampler is not None:
            if "data" in state_dict:
                self.sampler.load_state_dict(_own(state_dict["data"]))
            else:
                missing.append("'data' (the sampler's position: it starts its epoch afresh)")
        if missing:
            warnings.warn(
                "TrainingState: the checkpoint has no per-rank "
                + " and no ".join(missing)
                + "; it was saved or resharded without per-rank state",
                UserWarning,
                stacklevel=2,
            )
        for key, value in dict(state_dict.get("extra", {})).items():
            if key in self.extra and hasattr(self.extra[key], "load_state_dict"):
                continue  # statefuls were loaded in place
            self.extra[key] = value
