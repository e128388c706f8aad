"""Every private API of PyTorch, DCP, Lightning and transformers that ``ckptfmt_torch`` uses is an
entry of ``ckptfmt_torch._compat.PRIVATE``: each entry resolves against the installed frameworks
with the parameters the adapter passes (a framework upgrade that renames or changes one fails
here, one test per hook); a name that is missing gives ``FrameworkCompatError`` naming the
framework, its version, the name and the supported range; the supported ranges are the extras'
bounds in pyproject.toml and hold the installed versions; no private name is used outside the
compat module."""

from __future__ import annotations

import inspect
import re
import sys
import tomllib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

import ckptfmt_torch.lightning  # noqa: E402, F401  (wraps Lightning's loader)
from ckptfmt_torch import _compat  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

from ckptfmt.errors import FrameworkCompatError, UsageError  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[3]
ADAPTER = ROOT / "adapters" / "ckptfmt_torch"
UNIFIED = {k for k, e in _compat.PRIVATE.items() if e.framework == "lightning"}


@pytest.mark.parametrize("key", sorted(set(_compat.PRIVATE) - UNIFIED))
def test_every_private_name_resolves_with_the_parameters_passed(key: str) -> None:
    """The name is there, its signature takes every parameter the adapter passes by name, and
    its probe (where it has one) finds the behaviour relied on."""
    entry = _compat.PRIVATE[key]
    found = _compat.resolve(entry)
    assert found is not None
    if entry.params:
        params = inspect.signature(found).parameters
        assert set(entry.params) <= set(params), (entry.qualname, list(params))
    assert _compat.private(key) is found


@pytest.mark.parametrize("key", sorted(UNIFIED))
def test_unified_lightning_loaders_resolve_where_installed(key: str) -> None:
    """The unified ``lightning`` package's loaders: checked where it is installed."""
    pytest.importorskip("lightning")
    assert _compat.resolve(_compat.PRIVATE[key]) is not None


def test_a_missing_name_names_framework_version_and_range() -> None:
    """The real resolution, asked for a name torch does not have: a loud usage error naming
    torch, its installed version, the name and the supported range (never a silent None)."""
    entry = _compat.Private("torch", "torch.distributed.tensor._utils", "no_such_function_x")
    with pytest.raises(FrameworkCompatError) as info:
        _compat.resolve(entry)
    err = info.value
    assert isinstance(err, UsageError) and not isinstance(err, ImportError)
    assert err.framework == "torch" and err.version == torch.__version__
    assert err.name == "torch.distributed.tensor._utils.no_such_function_x"
    assert err.supported == _compat.SUPPORTED["torch"] and "missing" in err.reason
    for part in ("torch", torch.__version__, err.name, _compat.SUPPORTED["torch"]):
        assert part in str(err)


def test_a_lost_parameter_and_a_missing_module_are_loud() -> None:
    """A parameter the adapter passes that the framework no longer takes, a module gone, and a
    probe that finds the behaviour changed: each ``FrameworkCompatError`` with its reason."""
    lost = _compat.Private(
        "transformers", "transformers:Trainer", "_load_scaler", ("checkpoint", "no_such_param")
    )
    with pytest.raises(FrameworkCompatError, match="no parameter no_such_param") as info:
        _compat.resolve(lost)
    assert info.value.version == sys.modules["transformers"].__version__
    gone = _compat.Private("pytorch-lightning", "pytorch_lightning.no_such_module", "pl_load")
    with pytest.raises(FrameworkCompatError, match="cannot be imported") as info:
        _compat.resolve(gone)
    assert info.value.framework == "pytorch-lightning"
    assert info.value.version == sys.modules["pytorch_lightning"].__version__
    probed = _compat.Private("torch", "torch.nn:Module", "state_dict", check=lambda f: "changed")
    with pytest.raises(FrameworkCompatError, match="changed"):
        _compat.resolve(probed)


def test_state_dict_metadata_probe_sees_a_change() -> None:
    """The probe of ``state_dict()._metadata`` fails on a ``state_dict`` that no longer tags
    its dict (here a stand-in returning a plain dict), and passes on torch's own."""
    probe = _compat.PRIVATE["state_dict.metadata"].check
    assert probe is not None
    assert probe(torch.nn.Module.state_dict) is None
    assert "no longer tags" in (probe(lambda m: dict(m.named_parameters())) or "")


def test_supported_ranges_are_the_extras_bounds_and_hold_the_installed_versions() -> None:
    """Each framework of the compat module has an upper bound in every extra that pulls it,
    equal to the compat module's range, and the installed version lies in it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    seen = set()
    for requirements in extras.values():
        for req in requirements:
            m = re.match(r"^([A-Za-z0-9_.-]+)(.*)$", req)
            assert m is not None
            name, spec = m[1], m[2]
            if name in _compat.SUPPORTED:
                assert spec == _compat.SUPPORTED[name], (req, _compat.SUPPORTED[name])
                assert "<" in spec
                seen.add(name)
    assert seen == {"torch", "pytorch-lightning", "transformers"}
    for framework in seen:
        version = Version(_compat.installed_version(framework).split("+")[0])
        assert version in SpecifierSet(_compat.SUPPORTED[framework]), framework


def test_no_private_framework_name_outside_the_compat_module() -> None:
    """Outside ``_compat.py``, no module of the adapter imports a private framework name or
    reads a private attribute through ``getattr``; the private ``Trainer`` methods ``hf.py``
    overrides are all registered (so checked when a trainer is made)."""
    private_import = re.compile(
        r"^\s*from (torch|transformers|pytorch_lightning|lightning)\S* "
        r"import .*\b_[a-z]",
        re.M,
    )
    private_getattr = re.compile(r"getattr\([^,]+, \"_[a-z]")
    for path in sorted(ADAPTER.glob("*.py")):
        if path.name == "_compat.py":
            continue
        text = path.read_text()
        assert not private_import.search(text), path.name
        assert not private_getattr.search(text), path.name
        assert "._utils" not in text and "pl_load =" not in text, path.name
    hf = (ADAPTER / "hf.py").read_text()
    import transformers

    methods = set(re.findall(r"^    def (_[a-z][a-z_]*)\(", hf, re.M))
    overridden = {name for name in methods if hasattr(transformers.Trainer, name)}
    assert overridden == set(_compat.TRAINER_OVERRIDES)


def test_lightning_loaders_are_wrapped_once() -> None:
    """Importing the plugin wrapped ``pl_load`` in both loader modules, and wrapping again
    leaves the one wrapper in place."""
    before = {}
    for name in _compat.LIGHTNING_LOADERS["pytorch-lightning"]:
        before[name] = sys.modules[name].__dict__["pl_load"]
        assert hasattr(before[name], "ckptfmt_wraps"), name
    _compat.wrap_lightning_loader(lambda f: f)
    for name, fn in before.items():
        assert sys.modules[name].__dict__["pl_load"] is fn


def test_the_trainer_check_passes_and_names_a_missing_field() -> None:
    """``check_trainer`` (run when a ckptfmt ``Trainer`` is made) passes on the installed
    transformers; a ``TrainerState`` field the mixin relies on, were it gone, is named."""
    _compat.check_trainer()
    import transformers

    assert set(_compat.TRAINER_STATE_FIELDS) <= set(transformers.TrainerState.__dataclass_fields__)
    entry = _compat.Private("transformers", "transformers:TrainerState", "no_such_field_x")
    wanted = rf"transformers {re.escape(transformers.__version__)} is not supported"
    with pytest.raises(FrameworkCompatError, match=wanted):
        _compat.resolve(entry)
