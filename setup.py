"""Packaging glue that pyproject.toml cannot express: ship the zarr data-type start-up hook.

The ``.pth`` file must sit at the top of site-packages; see ``ckptfmt/zarr_plugin.py`` for why it
exists. Everything else about the package is declared in ``pyproject.toml``.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ckptfmt_zarr_dtypes.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("tools", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = dict(super().get_output_mapping())
        mapping[os.path.join(self.build_lib, PTH)] = os.path.join("tools", PTH)
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
