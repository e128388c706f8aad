"""Packaging glue that pyproject.toml cannot express: ship the zarr data-type start-up hook.

The ``.pth`` file must sit at the top of site-packages; see ``ckptfmt/zarr_plugin.py`` for why it
exists. Everything else about the package is declared in ``pyproject.toml``.

A wheel gets it from ``build_py``'s output directory, whose top level is the wheel's. An editable
install (``pip install -e .``, PEP 660) builds its wheel from other parts: ``build_py`` copies
nothing, and the editable wheel keeps of ``build_lib`` only the import paths of the packages. There
setuptools points the ``install`` command's ``install_lib`` at the unpacked editable wheel, whose
top level is installed into site-packages as a regular wheel's is, so the hook goes there.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ckptfmt_zarr_dtypes.pth"
SOURCE = os.path.join("tools", PTH)


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            top = self.get_finalized_command("install").install_lib
            self.copy_file(SOURCE, os.path.join(top, PTH))
        else:
            self.copy_file(SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = dict(super().get_output_mapping())
        if not self.editable_mode:
            mapping[os.path.join(self.build_lib, PTH)] = SOURCE
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
