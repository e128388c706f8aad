"""The data position of a Hugging Face ``Trainer`` run, kept global so that a run resumes at
another ``--nproc-per-node`` (``ckptfmt_torch.hf`` saves and uses it).

HF's order does not depend on the number of ranks: one shuffled permutation per epoch, cut into
per-device batches of ``b``; with ``W`` ranks (accelerate's ``BatchSamplerShard``) rank ``r``
takes batch ``s * W + r`` at its ``s``-th batch. One optimizer step so takes ``W * b * ga``
samples (``ga``: gradient accumulation). The position saved is ``{"epoch": e, "samples": c,
"world_size": W, "per_step": W * b * ga}``: ``c`` samples of epoch ``e``'s order consumed.

HF itself skips ``global_step % steps_per_epoch`` optimizer steps of this run's loader on
resume, right only at the world size that saved. At another one the step counter keeps
counting optimizer steps, and the data skip becomes ``c / (W' * b * ga)`` steps of the new
size's loader: possible only when ``c`` is a multiple of the new samples per step (the loader
skips whole per-rank batches); anything else is refused with
:class:`~ckptfmt.errors.DataPositionError`, never rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptfmt.errors import DataPositionError, UsageError


@dataclass(frozen=True)
class Epochs:
    """Where this run's epochs start in optimizer steps: epoch ``k`` begins at global step
    ``origin + k * steps_per_epoch`` (``origin`` is 0 unless the run resumed at another world
    size, whose steps took another number of samples)."""

    steps_per_epoch: int
    origin: int = 0

    def position(self, global_step: int, length: int, per_step: int, world: int) -> dict[str, Any]:
        """The saved position after ``global_step`` optimizer steps."""
        k = global_step - self.origin
        epoch, done = divmod(k, self.steps_per_epoch)
        return {
            "epoch": epoch,
            "samples": min(done * per_step, length),
            "world_size": world,
            "per_step": per_step,
        }


def length(dataset: Any) -> int | None:
    """The number of samples of a map-style training set; None for one without a length (an
    iterable dataset: HF's own data skip applies)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def resume(
    saved: Any, global_step: int, steps_per_epoch: int, length: int, per_step: int
) -> tuple[int, int, Epochs]:
    """From a saved position: the epoch to resume in, the optimizer steps of it already done in
    this run's units, and this run's :class:`Epochs`. Raises ``DataPositionError`` for a
    position this run cannot continue."""
    try:
        epoch, samples = int(saved["epoch"]), int(saved["samples"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"not a saved data position: {saved!r}") from exc
    if not 0 <= samples <= length:
        raise DataPositionError(
            f"{samples} samples consumed of an epoch of {length}: the checkpoint is of another "
            "dataset (train on the dataset it was saved with)",
            expected=length,
            actual=samples,
        )
    if samples == length:  # the epoch was done
        epoch, samples = epoch + 1, 0
    if samples % per_step:
        raise DataPositionError(
            f"{samples} samples of epoch {epoch} consumed, not a multiple of this run's "
            f"{per_step} samples per optimizer step (ranks x per_device_train_batch_size x "
            "gradient_accumulation_steps): HF's loader skips whole batches; resume with a "
            f"number of ranks, batch size or accumulation whose product divides {samples}",
            expected=per_step,
            actual=samples,
        )
    done = samples // per_step
    return epoch, done, Epochs(steps_per_epoch, global_step - epoch * steps_per_epoch - done)
