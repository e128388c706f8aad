"""The test suite's shared kit: what more than one test module (or worker script) needs.

- ``kit.arrays``: states with every dtype and bit pattern (random bytes), bit-exact comparison,
  and a nested state flattened to '/'-joined names.
- ``kit.files``: a checkpoint's manifest as a document, snapshots and digests of a directory's
  files, the leftovers an interrupted write would leave, and the files a manifest says a
  checkpoint holds.
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
- ``kit.full_disk``: code run beside a small tmpfs in a mount namespace of its own.
- ``kit.gf256_ref``: GF(2^8) arithmetic written from the redundancy spec alone.
- ``kit.plans``: save plans of fixed declarations as JSON (the same in every process).
- ``kit.zarr_reader``: zarr-python reading a checkpoint in a process without ckptfmt.

Test modules import it as ``kit`` (``tests/`` is on pytest's ``pythonpath``, as ``tests/workers/``
is for the tests that import a worker's helpers); the worker scripts in ``tests/workers/``, run as
``python [-m mpi4py] tests/workers/_x_worker.py``, find it because :mod:`kit.launch` puts
``tests/`` first on their ``PYTHONPATH``. A test module never imports another test module: what
two of them share lives here. This package itself imports nothing heavy, so that a worker pays
only for the modules it uses.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
