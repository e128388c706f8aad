"""Every private API of Keras and TensorFlow that ``ckptfmt_keras`` uses is an entry of
``ckptfmt_keras._compat.PRIVATE``: each entry resolves against the installed frameworks with the
parameters the adapter passes, per-object attributes are on the objects Keras makes, and the
behaviour relied on holds (``fit`` starts at ``_initial_epoch``; ``_symbolic_build`` builds
the compiled metrics; ``fit``'s epoch iterator is found from ``on_train_begin``); a missing name
gives ``FrameworkCompatError`` naming the framework, its version, the name and the supported
range; the ranges are the extras' bounds."""

from __future__ import annotations

import importlib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from ckptfmt_keras import _compat  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

from ckptfmt.errors import FrameworkCompatError, UsageError  # noqa: E402

pytestmark = pytest.mark.tf

ROOT = Path(__file__).resolve().parents[3]
ADAPTER = ROOT / "adapters" / "ckptfmt_keras"


def _model() -> Any:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.1), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def _examples() -> dict[str, Any]:
    """An object of the owner of each entry, as the adapter meets them."""
    model = _model()
    return {
        "keras:Model": model,
        "keras.layers:Layer": model.layers[0],
        "tensorflow:Module": tf.Module(),
        "keras.src.trainers.epoch_iterator": importlib.import_module(
            "keras.src.trainers.epoch_iterator"
        ),
    }


@pytest.mark.parametrize("key", sorted(_compat.PRIVATE))
def test_every_private_name_resolves_on_the_objects_keras_makes(key: str) -> None:
    """The owner imports; a class-level name takes every parameter the adapter passes; a
    per-object attribute is on a freshly made object of that class."""
    entry = _compat.PRIVATE[key]
    owner = _compat.resolve(entry)
    assert owner is not None and _compat.private(key) is owner
    value = _compat._attribute(key, _examples()[entry.where])
    if entry.params:
        assert callable(value)


def test_initial_epoch_is_where_fit_starts() -> None:
    """``fit`` starts at the epoch set through the compat module, and at its argument again
    once unset (what the callback's resume relies on)."""
    x, y = np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    model = _model()
    seen: list[int] = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(epoch))
    _compat.set_initial_epoch(model, 2)
    model.fit(x, y, epochs=3, verbose=0, callbacks=[record])
    assert seen == [2]
    _compat.set_initial_epoch(model, None)
    seen.clear()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[record])
    assert seen == [0, 1]


def test_fit_is_found_to_carry_its_data_across_epochs() -> None:
    """From ``on_train_begin``, ``carried_batches`` finds ``fit``'s epoch iterator: with
    ``steps_per_epoch`` fewer than the data's batches (arrays: 4 of 6; a repeated dataset: of
    unknown length) it says so, with none or all of them it gives None (each epoch starts the
    data afresh)."""
    x, y = np.ones((12, 3), np.float32), np.ones((12, 2), np.float32)
    seen: list[Any] = []
    record = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append(_compat.carried_batches())
    )
    model = _model()
    model.fit(x, y, batch_size=2, steps_per_epoch=4, epochs=1, verbose=0, callbacks=[record])
    model.fit(x, y, batch_size=2, steps_per_epoch=6, epochs=1, verbose=0, callbacks=[record])
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[record])
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(2).repeat()
    model.fit(repeated, steps_per_epoch=3, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    assert seen == [(4, 6), None, None, (3, None)]


def test_symbolic_build_builds_the_compiled_metrics() -> None:
    """Compiled metrics not yet built become built from one batch's shapes, nothing trained."""
    model = _model()
    before = [w.numpy().copy() for w in model.trainable_weights]
    assert _compat.metrics_unbuilt(model)
    _compat.build_metrics_from(model, (np.ones((2, 3), np.float32), np.ones((2, 2), np.float32)))
    assert not _compat.metrics_unbuilt(model)
    assert model.metrics_variables
    for a, b in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())


def test_names_of_layers_and_modules() -> None:
    """A layer's sub-layers and seed generators, and a ``tf.Module``'s variables by path."""
    model = _model()
    assert [type(x).__name__ for x in _compat.sublayers(model)][-2:] == ["Dropout", "Dense"]
    assert len(_compat.seed_generators(model.layers[0])) == 1
    module = tf.Module()
    module.inner = tf.Module()
    module.inner.v = tf.Variable(1.0)
    named = _compat.module_variables(module, lambda x: isinstance(x, tf.Variable))
    assert [n for n, _ in named] == ["inner/v"]


def test_a_missing_name_names_framework_version_and_range() -> None:
    """The real resolution, asked for a name Keras does not have, and a per-object attribute
    an object lacks: loud usage errors naming keras, its version, the name and the range."""
    entry = _compat.Private("keras", "keras:Model", "_no_such_private_hook")
    with pytest.raises(FrameworkCompatError) as info:
        _compat.resolve(entry)
    err = info.value
    assert isinstance(err, UsageError) and not isinstance(err, ImportError)
    assert (err.framework, err.version) == ("keras", keras.__version__)
    assert err.name == "keras.Model._no_such_private_hook"
    assert err.supported == _compat.SUPPORTED["keras"]
    for part in ("keras", keras.__version__, err.name, _compat.SUPPORTED["keras"]):
        assert part in str(err)
    with pytest.raises(FrameworkCompatError, match="_initial_epoch is missing on a object"):
        _compat.set_initial_epoch(object(), 1)
    lost = _compat.Private("tensorflow-cpu", "tensorflow:Module", "_flatten", ("no_such_arg",))
    with pytest.raises(FrameworkCompatError, match="no parameter no_such_arg") as info:
        _compat.resolve(lost)
    assert info.value.version == tf.__version__


def test_supported_ranges_are_the_extras_bounds_and_hold_the_installed_versions() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    seen = set()
    for requirements in extras.values():
        for req in requirements:
            m = re.match(r"^([A-Za-z0-9_.-]+)(.*)$", req)
            assert m is not None
            if m[1] in _compat.SUPPORTED:
                assert m[2] == _compat.SUPPORTED[m[1]], req
                seen.add(m[1])
    assert seen == set(_compat.SUPPORTED)
    for framework in seen:
        version = Version(_compat.installed_version(framework))
        assert version in SpecifierSet(_compat.SUPPORTED[framework]), framework


def test_no_private_framework_name_outside_the_compat_module() -> None:
    """Outside ``_compat.py`` no module of the adapter touches the registered private names."""
    names = {e.name for e in _compat.PRIVATE.values()}
    for path in sorted(ADAPTER.glob("*.py")):
        if path.name != "_compat.py":
            text = path.read_text()
            assert not [n for n in names if re.search(rf"[.\"']{n}\b", text)], path.name
