"""The ``ckptfmt`` command-line tool. It uses only the public core API and runs without MPI.

Modules: ``main`` (the click group and its commands), ``exits`` (the exit-status table and the
mapping of errors to it), ``summary`` (the inspect document), ``render`` (rich output).
"""
