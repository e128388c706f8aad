"""zarr-python reading a checkpoint in a process that never imports ckptfmt: what the format and
fixture tests use to show that a checkpoint is a plain zarr v3 hierarchy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

READER = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import zarr

    group = zarr.open_group(sys.argv[1], mode="r")
    out = {}
    for name, node in group.members(max_depth=None):
        if isinstance(node, zarr.Array):
            data = node[...]
            data = np.asarray(data)
            out[name] = {
                "shape": list(data.shape),
                "array_shape": list(node.shape),
                "dtype": str(data.dtype),
                "byteorder": data.dtype.byteorder,
                "sha256": hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest(),
            }
    print(json.dumps(out))
    """
)


def zarr_read(tmp_path: Path, root: Path) -> dict[str, Any]:
    """Every array of the hierarchy at ``root`` as zarr-python reads it (shape, dtype, byte
    order, sha256 of its bytes), from a process started in a fresh folder under ``tmp_path``."""
    assert "ckptfmt" not in READER  # the reading program knows nothing of ckptfmt
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", READER, str(root.resolve())],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
