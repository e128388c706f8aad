"""A full file system: ``ckptfmt.save`` and ``ckptfmt reshard`` into a small tmpfs,
out of bytes and out of inodes. The error is a :class:`StorageFullError` (a CkptError and an
OSError with errno ENOSPC), names the directory, the bytes the save needed and the space that was
free, says "write", and nothing is left behind (no staging directory, no checkpoint).

Each case runs in a child process in its own mount namespace (``unshare``), where a tmpfs of a
few hundred KiB is mounted; the host's mounts are never touched."""

from __future__ import annotations

import re
from pathlib import Path

from kit.full_disk import in_full_tmpfs

SAVE = """
import errno, json, os
import numpy as np
import ckptfmt
from ckptfmt.errors import CkptError, StorageFullError
state = STATE
target = os.path.join(MNT, "step-0000000001")
out = {}
try:
    ckptfmt.save(state, target, step=1)
    out["error"] = None
except OSError as exc:  # except OSError keeps working
    out.update(
        error=type(exc).__name__, ckpt=isinstance(exc, CkptError), errno=exc.errno,
        message=str(exc), path=getattr(exc, "path", None),
        needed=getattr(exc, "needed", None), free=getattr(exc, "free", None),
        free_inodes=getattr(exc, "free_inodes", None), level=getattr(exc, "level", None),
    )
out["left"] = sorted(os.listdir(MNT))
print(json.dumps(out))
"""


def check_full(out: dict[str, object], mnt: Path) -> None:
    assert out["error"] == "StorageFullError", out
    assert out["ckpt"] is True and out["errno"] == 28
    message = str(out["message"])
    assert "write" in message and "no space left on device" in message
    target = str(mnt / "step-0000000001")
    assert out["path"] == target and target in message
    assert out["level"] and str(out["level"]) in message
    assert f"{out['free']} bytes free" in message and f"needs {out['needed']} bytes" in message
    assert out["left"] == [], out  # the staging directory is removed, no checkpoint appears


def test_save_out_of_bytes(tmp_path: Path) -> None:
    code = "STATE = {'w': np.ones((1024, 1024), np.float32), 'step': 1}\n" + SAVE
    out = in_full_tmpfs(tmp_path, "size=512k", code)
    check_full(out, tmp_path / "mnt")
    assert isinstance(out["needed"], int) and out["needed"] >= 4 << 20
    assert isinstance(out["free"], int) and out["free"] < 512 << 10


def test_save_out_of_inodes(tmp_path: Path) -> None:
    code = (
        "STATE = {f'layer{i}': {'w': np.ones(4, np.float32), 'b': np.ones(2, np.float32)}"
        " for i in range(40)}\n" + SAVE
    )
    out = in_full_tmpfs(tmp_path, "size=64m,nr_inodes=24", code)
    check_full(out, tmp_path / "mnt")
    assert out["free_inodes"] == 0 or f"{out['free_inodes']} inodes free" in str(out["message"])


def test_reshard_into_a_full_file_system(tmp_path: Path) -> None:
    code = """
    import json, os
    import numpy as np
    import ckptfmt
    from click.testing import CliRunner
    from ckptfmt_cli.main import cli
    src = os.path.join(os.path.dirname(MNT), "src")
    ckptfmt.save({"w": np.ones((512, 1024), np.float32)}, src,
                 write=ckptfmt.WriteOptions(fsync=False))
    dst = os.path.join(MNT, "dst")
    result = CliRunner().invoke(cli, ["reshard", src, dst, "--ranks", "2"])
    print(json.dumps({"code": result.exit_code, "output": result.output,
                      "left": sorted(os.listdir(MNT))}))
    """
    out = in_full_tmpfs(tmp_path, "size=256k", code)
    output = str(out["output"])
    assert out["code"] != 0
    assert "cannot write" in output and "no space left on device" in output, output
    assert "cannot read" not in output
    needs = re.search(r"the write needs (\d+) bytes; (\d+) bytes free", output)
    assert needs and int(needs[1]) >= 512 * 1024 * 4, output  # at least the tensor's bytes
    assert "the reshard's destination" in output and str(tmp_path / "mnt" / "dst") in output
    assert out["left"] == []
