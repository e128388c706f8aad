"""The test suite's shared kit: what more than one test module (or worker script) needs.

- ``kit.arrays``: states with every dtype and bit pattern (random bytes), bit-exact comparison,
  and a nested state flattened to '/'-joined names.
- ``kit.files``: a checkpoint's manifest as a document, snapshots and digests of a directory's
  files, and the leftovers an interrupted write would leave.
- ``kit.faults``: damage on purpose: bit flips in files and in bytes.
- ``kit.guards``: a memory cap, a time limit and an ``open()`` tracker around code under test.
- ``kit.launch``: ``mpiexec`` and ``torchrun`` jobs under a timeout, and their failure messages.
- ``kit.worker``: what the scripts those jobs run share (the communicator, the simulated node
  of a rank, the end of a torchrun rank).
- ``kit.level1``: real level-1 checkpoints of several simulated nodes, saved in this process.
- ``kit.reshard``: a checkpoint saved by N thread-ranks in this process, and the chunks a box of
  a tensor needs (brute force), for the tests that load or rewrite it at another size.
- ``kit.cli``: the ``ckptfmt`` command line run in this process.
- ``kit.managers``: ``CheckpointManager`` factories for in-process tests.

Test modules import it as ``kit`` (pytest puts ``tests/`` on ``sys.path`` for the rootdir
``conftest.py``); the worker scripts, run as ``python [-m mpi4py] tests/_x_worker.py``, find it
in their own folder (a script's folder is ``sys.path[0]``). This package itself imports nothing
heavy, so that a worker pays only for the modules it uses.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
