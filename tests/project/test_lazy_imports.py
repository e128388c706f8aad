"""A restart pays only for the imports its restore needs (issue 36, "the whole restart").

``import ckptfmt`` and ``import ckptfmt_torch`` load neither ``ml_dtypes`` (about half a second
of extension) nor ``torch.distributed.tensor`` / ``torch.distributed.checkpoint`` (a second or
more), nor zarr, numcodecs, obstore or click; a save and a restore of a ``float32`` state load
none of them either. Each case runs in a fresh interpreter (``sys.modules`` of this test process
holds everything already). A ``bfloat16`` or ``float8`` tensor met later still round-trips bit
for bit, through the core and through the PyTorch adapter, in a process that never imported
``ml_dtypes`` itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEAVY_CORE = ("ml_dtypes", "zarr", "numcodecs", "obstore", "click", "torch", "tensorflow")
HEAVY_TORCH = (
    "ml_dtypes",
    "zarr",
    "numcodecs",
    "obstore",
    "click",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
)


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (it fails the test on a non-zero exit)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _loaded(names: tuple[str, ...]) -> str:
    return f"print(sorted(m for m in {names!r} if m in sys.modules))"


def test_import_ckptfmt_loads_nothing_heavy() -> None:
    out = _run(f"import sys\nimport ckptfmt\n{_loaded(HEAVY_CORE)}")
    assert out.strip() == "[]"


def test_core_float32_round_trip_loads_no_ml_dtypes(tmp_path: Path) -> None:
    out = _run(
        f"""
        import sys
        import numpy as np
        import ckptfmt
        a = np.arange(1000, dtype=np.float32).reshape(10, 100)
        ckptfmt.save({{"m": {{"w": a, "step": 3}}}}, {str(tmp_path / "c")!r})
        got = ckptfmt.load({str(tmp_path / "c")!r})
        assert got["m"]["step"] == 3 and got["m"]["w"].tobytes() == a.tobytes()
        {_loaded(HEAVY_CORE)}
        """
    )
    assert out.strip() == "[]"


def test_core_reads_bfloat16_in_a_process_that_never_imported_ml_dtypes(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    _run(
        f"""
        import ml_dtypes
        import numpy as np
        import ckptfmt
        bits = np.arange(-300, 300, dtype=np.int16)  # every sign, subnormals, NaN patterns
        ckptfmt.save({{
            "b": bits.view(ml_dtypes.bfloat16),
            "f8": bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn),
            "f8b": bits.astype(np.uint8).view(ml_dtypes.float8_e5m2),
        }}, {path!r})
        """
    )
    out = _run(
        f"""
        import sys
        import numpy as np
        import ckptfmt
        assert "ml_dtypes" not in sys.modules
        got = ckptfmt.load({path!r})
        bits = np.arange(-300, 300, dtype=np.int16)
        assert got["b"].dtype.name == "bfloat16", got["b"].dtype
        assert got["b"].view(np.int16).tobytes() == bits.tobytes()
        assert got["f8"].dtype.name == "float8_e4m3fn"
        assert got["f8"].view(np.uint8).tobytes() == bits.astype(np.uint8).tobytes()
        assert got["f8b"].dtype.name == "float8_e5m2"
        assert got["f8b"].view(np.uint8).tobytes() == bits.astype(np.uint8).tobytes()
        print("ml_dtypes" in sys.modules)
        """
    )
    assert out.strip() == "True"  # loaded when the first bfloat16 was met, not before


@pytest.mark.torch
def test_import_ckptfmt_torch_and_a_float32_restore_load_nothing_heavy(tmp_path: Path) -> None:
    """The restore into a module alone: creating a ``torch.optim`` optimizer imports
    ``torch._dynamo`` and with it ``torch.distributed.tensor`` (PyTorch's own cost, paid by
    ``torch.load`` as much as by us), so the optimizer's restore is checked for the others."""
    pytest.importorskip("torch")
    path = str(tmp_path / "c")
    _run(
        f"""
        import torch
        import ckptfmt_torch
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        ckptfmt_torch.save({{"model": model, "optim": opt, "step": 7}}, {path!r})
        torch.save(model.state_dict(), {path + ".pt"!r})
        """
    )
    out = _run(
        f"""
        import sys
        import torch
        import ckptfmt_torch
        {_loaded(HEAVY_TORCH)}
        m2 = torch.nn.Linear(64, 32)
        state = {{"model": m2, "step": 0}}
        ckptfmt_torch.load(state, {path!r})
        want = torch.load({path + ".pt"!r})
        assert state["step"] == 7
        assert torch.equal(m2.weight, want["weight"]) and torch.equal(m2.bias, want["bias"])
        {_loaded(HEAVY_TORCH)}
        o2 = torch.optim.Adam(m2.parameters())
        ckptfmt_torch.load({{"optim": o2}}, {path!r})
        assert o2.state[m2.weight]["exp_avg_sq"].abs().sum() > 0
        {_loaded(tuple(m for m in HEAVY_TORCH if m != "torch.distributed.tensor"))}
        """
    )
    assert out.split("\n")[:3] == ["[]", "[]", "[]"]


@pytest.mark.torch
def test_torch_bfloat16_and_float8_round_trip_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = _run(
        f"""
        import sys
        import torch
        import ckptfmt_torch
        bits = torch.arange(-32768, 32768, 7, dtype=torch.int32).to(torch.int16)
        saved = {{
            "b": bits.view(torch.bfloat16),
            "f8": bits.to(torch.uint8).view(torch.float8_e4m3fn),
            "f8b": bits.to(torch.uint8).view(torch.float8_e5m2),
        }}
        ckptfmt_torch.save(saved, {str(tmp_path / "c")!r})
        into = {{k: torch.zeros_like(v) for k, v in saved.items()}}
        ckptfmt_torch.load(into, {str(tmp_path / "c")!r})
        for k, v in saved.items():
            assert into[k].dtype == v.dtype
            width = torch.int16 if v.dtype == torch.bfloat16 else torch.uint8
            assert torch.equal(into[k].view(width), v.view(width)), k
        print("ml_dtypes" in sys.modules, "torch.distributed.tensor" in sys.modules)
        """
    )
    assert out.strip() == "True False"
