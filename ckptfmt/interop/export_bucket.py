"""Writing an export into a bucket prefix ``U`` (``ckptfmt export SRC s3://bucket/hf``).

The output is a Hugging Face directory, not a ckptfmt checkpoint: other tools read it as plain
keys ``U/<file>``, so it has no ``U/<save_id>/`` draft and no commit object. Each file is put
straight from the tensors as they are read (:data:`BUCKET_WINDOW` ahead of the writer), with
no local copy: a file up to :data:`MULTIPART_ABOVE` is assembled in memory and put
in one PUT, a bigger one streamed in parts of ``part_size`` (``Bucket.upload_parts``: at most
``UPLOAD_CONCURRENCY`` parts in flight). Memory therefore stays within the read window (at
least the tensor being sent and the next one, each read whole), the file being assembled when
small, and the parts in flight, whatever the size of the export: measured (``bench/
bench_interop_bucket.py``) 244 MiB peak RSS for 256 MiB of 32 MiB tensors, 437 MiB for
1 GiB of 128 MiB tensors.

The commit is the key a reader opens first, put last: the index of a sharded export (after
every shard), or ``model.safetensors`` of a single-file one (after the configuration files).
An export into an empty prefix that fails before it deletes what it put; an overwrite replaces
the keys it writes one by one (a bucket has no rename: a sharded overwrite cut short can leave
new shards beside the old index) and deletes the old export's other keys after its commit.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import numpy as np

from ckptfmt.errors import CkptError, DamagedError, DestinationExistsError
from ckptfmt.interop import hf
from ckptfmt.interop.export_plan import ExportFile, Planned
from ckptfmt.interop.export_read import ReadAhead, cast_array
from ckptfmt.maintenance.source import Source
from ckptfmt.storage.objects.bucket import MULTIPART_ABOVE, Bucket, part_size
from ckptfmt.storage.objects.commit import COMMIT_NAME
from ckptfmt.storage.progress import Meter, current_meter

BUCKET_WINDOW = 64 << 20
"""The bytes read ahead of the upload (unless ``window_bytes`` says otherwise): the parts in
flight already overlap the reads with the puts, so a window of a few parts keeps both busy
(measured: ``bench/bench_interop_bucket.py``); memory stays within it plus those parts."""


def export_key(name: str, writes: Sequence[str] = ()) -> bool:
    """Whether ``name`` is a key an export writes: the weights, the index, and the
    configuration files when this export writes them (``writes``)."""
    if name in (hf.SINGLE, hf.INDEX, *writes):
        return True
    return "/" not in name and name.startswith("model-") and name.endswith(".safetensors")


def check_bucket_out(bucket: Bucket, overwrite: bool, writes: Sequence[str] = ()) -> list[str]:
    """The keys under ``U`` now. Anything there is refused (:class:`DestinationExistsError`)
    unless ``overwrite``, and then only an earlier export's keys (a checkpoint's commit object,
    a ``config.json`` put there by hand when this export has none to put in its place: no)."""
    there = [key for key, _ in bucket.list("")]
    if there and not overwrite:
        raise DestinationExistsError(
            bucket.url,
            f"{len(there)} object(s) are there already "
            "(--overwrite, overwrite=True, replaces a previous export)",
        )
    if COMMIT_NAME in there:
        raise DestinationExistsError(
            bucket.url,
            f"a ckptfmt checkpoint is committed there ({COMMIT_NAME}): an export replaces only "
            "an earlier export",
        )
    for key in there:
        if not export_key(key, writes):
            raise DestinationExistsError(
                bucket.url, f"it holds {key!r}, which an export does not write"
            )
    return there


class _Failure:
    """The first error raised while handing bytes to the store's client (a CRC failure of a
    source chunk, say): re-raised as itself once the put returns, whatever the client made
    of it."""

    error: BaseException | None = None


def _pieces(
    reads: ReadAhead, tensors: Sequence[Planned], failure: _Failure, meter: Meter
) -> Iterator[memoryview]:
    """The bytes of ``tensors`` in file order, each read (and cast) as it is reached; each
    tensor's bytes counted on ``meter`` (the caller's: the store's client may pull the parts
    from a thread of its own) once handed on."""
    try:
        for p in tensors:
            arr = reads.take()
            if p.dtype != p.entry.dtype:
                arr = cast_array(arr, p.dtype)
            flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            yield flat.data
            meter.add(p.nbytes, "write")
    except GeneratorExit:  # closed before its end: the put failed, and says why itself
        raise
    except BaseException as exc:
        failure.error = exc
        raise


def _put_file(bucket: Bucket, f: ExportFile, reads: ReadAhead) -> None:
    """Put the file ``f`` at ``U/<f.name>``: header, then its tensors as they are read."""
    size = len(f.header) + sum(p.nbytes for p in f.tensors)
    failure = _Failure()
    pieces = _pieces(reads, f.tensors, failure, current_meter())
    try:
        if size <= MULTIPART_ABOVE:
            blob = bytearray(f.header)
            for piece in pieces:
                blob += piece
            if len(blob) != size:
                raise CkptError(f"internal: an export file of {size} bytes got {len(blob)}")
            bucket.put(f.name, blob)
        else:
            # any buffer will do: the client copies the bytes into parts of its own size
            stream = cast(Iterator[bytes], _stream(f.header, pieces, size))
            bucket.upload_parts(f.name, stream, size)
    except BaseException:
        if failure.error is not None:
            raise failure.error from None
        raise


def _stream(header: bytes, pieces: Iterator[memoryview], size: int) -> Iterator[memoryview]:
    """The bytes of a file of ``size`` bytes, as they come: ``header``, then ``pieces`` (the
    client cuts them into its parts, ``Bucket.upload_parts``, without a copy here); a file
    whose bytes disagree with the plan is an internal error, never a truncated object."""
    sent = len(header)
    step = part_size(size)
    yield memoryview(header)
    for piece in pieces:
        sent += piece.nbytes
        if sent > size:
            break
        for at in range(0, piece.nbytes, step):  # the client copies a part at a time, not all
            yield piece[at : at + step]
    if sent != size:
        raise CkptError(f"internal: an export file of {size} bytes got {sent} or more")


def write_to_bucket(
    source: Source,
    files: Sequence[ExportFile],
    planned: Sequence[Planned],
    bucket: Bucket,
    there: Sequence[str],
    threads: int,
    window: int,
    extra: Sequence[tuple[str, bytes]] = (),
) -> tuple[Source, int]:
    """Put ``extra`` (name, bytes), every file of ``files`` but the commit key, then the commit
    key (the index of a sharded export, else ``model.safetensors``), then delete the keys of
    ``there`` (what was under ``U`` before) it did not write. Returns the source as read
    (rebuilt, when level-1 copies needed it) and the stored bytes read from it.

    A level-1 source whose copies need rebuilding is rebuilt into a scratch directory of
    ``TMPDIR`` first (the one case this route uses local space: the parity rebuild reads and
    writes files)."""
    with contextlib.ExitStack() as stack:
        if source.level1 and source.problems():
            source = _rebuilt(source, stack)
        written: list[str] = []
        try:
            try:
                read = _put_all(source, files, planned, bucket, threads, window, extra, written)
            except DamagedError:
                if not source.level1 or source.rebuilt_nodes:
                    raise
                source = _rebuilt(source, stack)
                if not source.rebuilt_nodes:
                    raise
                read = _put_all(source, files, planned, bucket, threads, window, extra, written)
        except BaseException:
            if not there:  # nothing was there: what this export put goes
                with contextlib.suppress(CkptError, OSError):
                    bucket.delete(written)
            raise
        stale = sorted(set(there) - set(written))
        if stale:
            bucket.delete(stale)
    return source, read


def _rebuilt(source: Source, stack: contextlib.ExitStack) -> Source:
    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptfmt-rebuild-"))
    return source.with_rebuild(Path(scratch))


def _put_all(
    source: Source,
    files: Sequence[ExportFile],
    planned: Sequence[Planned],
    bucket: Bucket,
    threads: int,
    window: int,
    extra: Sequence[tuple[str, bytes]],
    written: list[str],
) -> int:
    for name, data in extra:
        bucket.put(name, data)
        written.append(name)
    order = [p.entry for f in files for p in f.tensors]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        reads = ReadAhead(source, order, pool, window)
        try:
            for f in files:
                _put_file(bucket, f, reads)
                written.append(f.name)
        except BaseException:
            reads.cancel()
            raise
    if len(files) > 1:
        where = {p.name: f.name for f in files for p in f.tensors}
        weight_map = {p.name: where[p.name] for p in planned}  # in the plan's order, as on disk
        bucket.put(hf.INDEX, hf.index_doc(sum(p.nbytes for p in planned), weight_map, {}))
        written.append(hf.INDEX)
    return reads.bytes_read
