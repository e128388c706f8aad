"""Interop with the formats models travel in: Hugging Face safetensors out and in, framework-free
(``ckptfmt export`` / ``ckptfmt import``; ``torch.save`` and DCP: ``ckptfmt_torch.interop``).

    from ckptfmt.interop import export_safetensors, import_safetensors

    export_safetensors("ckpt/step-0000000100", "hf-model", max_shard_size="5GB")
    import_safetensors("hf-model", "ckpt/imported")       # then ckptfmt_torch.load in place
"""

from __future__ import annotations

from ckptfmt.interop import hf
from ckptfmt.interop.export import ExportReport, export_safetensors, recover_export, tensors_of
from ckptfmt.interop.export_plan import CAST_TARGETS, select
from ckptfmt.interop.importer import ImportReport, import_named, import_safetensors
from ckptfmt.interop.names import Rename

__all__ = [
    "CAST_TARGETS",
    "hf",
    "select",
    "ExportReport",
    "ImportReport",
    "Rename",
    "export_safetensors",
    "import_named",
    "import_safetensors",
    "recover_export",
    "tensors_of",
]
