"""PyTorch adapter for ckptfmt; for now only the torch.distributed transport."""

from __future__ import annotations

from ckptfmt_torch.comm import TorchComm

__all__ = ["TorchComm"]
