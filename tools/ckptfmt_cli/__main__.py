"""``python -m ckptfmt_cli``: the same as the ``ckptfmt`` script."""

from __future__ import annotations

from ckptfmt_cli.main import main

main()
