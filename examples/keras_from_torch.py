"""A checkpoint written from PyTorch, read into a matching Keras model by name.

    .venv/bin/python examples/keras_from_torch.py [DIR]

The PyTorch side saves its ``state_dict`` as plain arrays (``ckptfmt.save``; a checkpoint of
``ckptfmt_torch`` holds the same names). The Keras side builds the same network and loads it
with ``ckptfmt_keras.load_variables`` and a name map written by hand: Keras variable path ->
tensor in the checkpoint. ``torch.nn.Linear`` keeps its weight as ``[out, in]`` and Keras's
``Dense`` its kernel as ``[in, out]``, so a ``transform`` transposes the kernels; nothing else is
converted, and every value arrives bit for bit. Only the tensors named in the map are read.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ckptfmt_keras
import keras
import numpy as np
import torch

import ckptfmt
from ckptfmt import WriteOptions

# Keras variable path -> name in the PyTorch checkpoint
NAME_MAP = {
    "net/fc1/kernel": "model/fc1.weight",
    "net/fc1/bias": "model/fc1.bias",
    "net/fc2/kernel": "model/fc2.weight",
    "net/fc2/bias": "model/fc2.bias",
}


def transpose_kernels(name: str, array: np.ndarray) -> np.ndarray:
    """``[out, in]`` (torch.nn.Linear.weight) -> ``[in, out]`` (keras Dense kernel)."""
    return np.ascontiguousarray(array.T) if name.endswith("/kernel") else array


class TorchNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def keras_net() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="fc1"),
            keras.layers.Dense(4, name="fc2"),
        ],
        name="net",
    )


def main(workdir: Path) -> None:
    torch.manual_seed(0)
    net = TorchNet()
    path = workdir / "torch-ckpt"
    state = {name: t.detach().numpy() for name, t in net.state_dict().items()}
    ckptfmt.save({"model": state, "step": 0}, path, write=WriteOptions(overwrite=True))
    print("PyTorch checkpoint:", sorted(ckptfmt.open(path).keys()))

    model = keras_net()
    loaded = ckptfmt_keras.load_variables(
        model, path, name_map=NAME_MAP, transform=transpose_kernels
    )
    print("Keras variables set:", loaded)

    for layer in ("fc1", "fc2"):
        kernel = model.get_layer(layer).kernel.numpy()
        weight = state[f"{layer}.weight"]
        assert kernel.tobytes() == np.ascontiguousarray(weight.T).tobytes()
        assert model.get_layer(layer).bias.numpy().tobytes() == state[f"{layer}.bias"].tobytes()
    print("kernels are the transposed torch weights, bit for bit; biases equal")

    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    got = np.asarray(model(x))
    print(f"largest output difference, Keras vs PyTorch: {np.abs(got - want).max():.2e}")
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
