"""Low-level file writing and reading: gathered writes straight from array memory, fsync.

Shard files are created with ``O_EXCL`` (a shard has exactly one writer and is never rewritten)
and written with ``os.writev`` from memoryviews of the caller's arrays: no staging copy. Reads go
with ``os.preadv`` straight into the destination arrays.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, Protocol, Self, TypeVar, runtime_checkable

from ckptfmt.errors import (
    CkptError,
    DamagedError,
    MissingFileError,
    NotRegularFileError,
    SizeMismatchError,
    StorageError,
    StorageFullError,
)

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

Buffer = bytes | bytearray | memoryview


COPY_BATCH = 1 << 20  # write_gather(copy_to=...): copy this much, then write it while cached


@runtime_checkable
class Stream(Protocol):
    """A file's bytes made batch by batch while it is written (``format.shard_io``: each
    chunk's CRC32C computed just before the chunk is written, while it is still in the cache,
    instead of in a pass of its own over the whole file). ``size``: the file's size, known
    before any batch is made."""

    size: int

    def batches(self) -> Iterator[Sequence[Buffer]]:
        """The file's pieces, in order, a batch (about ``COPY_BATCH`` bytes) at a time."""
        ...


def nbytes_of(pieces: Sequence[Buffer] | Stream) -> int:
    """The bytes ``pieces`` (a list of buffers, or a :class:`Stream`) amount to."""
    if isinstance(pieces, Stream):
        return pieces.size
    return sum(len(memoryview(p).cast("B")) for p in pieces)


def _batches(pieces: Sequence[Buffer] | Stream) -> Iterator[Sequence[Buffer]]:
    if isinstance(pieces, Stream):
        yield from pieces.batches()
    else:
        yield pieces


_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def physical_memory() -> int:
    """The bytes of memory this process may allocate at most: the machine's physical memory, or
    the address-space limit (``RLIMIT_AS``) when one is set and lower; 0 when neither is known.
    The default cap of what a reader allocates for data a manifest claims."""
    total = 0
    with contextlib.suppress(OSError, ValueError, AttributeError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            total = min(total, soft) if total else soft
    except (ImportError, OSError, ValueError):
        pass
    return total


def free_space(path: Path) -> tuple[int | None, int | None]:
    """The bytes and inodes free for an unprivileged writer on the file system of ``path`` (or
    of its nearest existing ancestor); None where unknown."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None, None
    return st.f_bavail * st.f_frsize, st.f_favail


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system is full or the quota spent."""
    return isinstance(exc, OSError) and exc.errno in _FULL


def storage_full(
    exc: OSError, path: Path, needed: int | None = None, directory: Path | None = None
) -> StorageFullError | None:
    """The :class:`StorageFullError` for ``exc`` raised while writing ``path`` (``needed``: the
    bytes of that write; ``directory``: where the operation writes, by default the file's
    directory) when the file system is full or the quota spent; None for any other error. The
    free space is measured at once, while the file system is still full."""
    if not is_full(exc):
        return None
    if directory is None:
        directory = path if path.is_dir() else path.parent
    free, inodes = free_space(directory)
    return StorageFullError(
        str(directory),
        err=exc.errno or errno.ENOSPC,
        writing=getattr(exc, "writing", None) or str(path),
        needed=needed if needed is not None else getattr(exc, "needed", None),
        free=free,
        free_inodes=inodes,
    )


def write_error(
    exc: BaseException | None, target: Path, level: str, needed: int | None = None
) -> StorageError | None:
    """A write into ``target`` (the directory or file an operation writes, named as the
    ``level`` it is: ``"the export's destination"``) that failed for want of room, as an error
    of the tree naming it: a full file system or quota as :class:`StorageFullError`
    (:func:`storage_full`, ``needed`` the bytes the operation writes), a file larger than the
    file system or the process's limit allows (``EFBIG``: ``ulimit -f``) as
    :class:`StorageError`. None for any other error: a failed read of the source stays what it
    was (no read fails with these)."""
    if isinstance(exc, StorageFullError):
        return exc.with_context(level, max(needed or 0, exc.needed or 0) or None, str(target))
    if not isinstance(exc, OSError) or isinstance(exc, CkptError):
        return None
    full = storage_full(exc, target, needed, directory=target)
    if full is not None:
        return full.with_context(level=level)
    if exc.errno == errno.EFBIG:
        reason = "cannot write: file too large for the file system or the file size limit"
        return StorageError(str(target), f"{reason} (ulimit -f)", level=level, err=exc.errno)
    return None


def write_gather(
    path: Path,
    pieces: Sequence[Buffer] | Stream,
    fsync: bool = True,
    copy_to: Any = None,
    in_place: bool = False,
) -> int:
    """:func:`_write_gather`, with a full file system raised as :class:`StorageFullError`."""
    try:
        return _write_gather(path, pieces, fsync, copy_to, in_place)
    except OSError as exc:
        full = storage_full(exc, path, nbytes_of(pieces))
        if full is None:
            raise
        raise full from None


def make_dirs(path: Path) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``, a full file system (no inode left) raised as
    :class:`StorageFullError`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        full = storage_full(exc, path)
        if full is None:
            raise
        raise full from None


def _write_gather(
    path: Path,
    pieces: Sequence[Buffer] | Stream,
    fsync: bool = True,
    copy_to: Any = None,
    in_place: bool = False,
) -> int:
    """Create ``path`` (it must not exist) holding the concatenation of ``pieces`` (buffers, or
    a :class:`Stream` written batch by batch as it makes them); return size.

    ``in_place`` (a save into a recycled step directory, ``storage/slots.py``): a regular file
    already at ``path`` is overwritten in place (its pages are there already: no allocation, no
    zeroing) and cut to the new size; one with other links (a hard link shared with another
    checkpoint) is never written through but replaced by a new file.

    ``copy_to`` (a writable uint8 array as long as the file): also leave the bytes there, copied
    batch by batch (about ``COPY_BATCH``) just before each batch is written from the copy, while
    it is still in the cache (a copy then a write of 32 MiB took 16% longer than the write alone
    on the development machine; copying and writing in 1 MiB batches, 8%)."""
    fd = _open_in_place(path) if in_place else -1
    if fd < 0:
        fd = os.open(path, _CREATE, 0o644)
    try:
        if in_place:
            total = nbytes_of(pieces)
            if os.fstat(fd).st_size > total:
                os.ftruncate(fd, total)  # before writing: the tail is never written for nothing
        if copy_to is not None:
            return _write_copying(fd, pieces, copy_to, fsync)
        total = 0
        for batch in _batches(pieces):
            total += _writev_all(fd, batch)
        if fsync:
            os.fsync(fd)
        return total
    finally:
        os.close(fd)


def _writev_all(fd: int, pieces: Sequence[Buffer]) -> int:
    """Write ``pieces`` at the file's position, every byte (short writes are resumed)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total = sum(len(v) for v in views)
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        written = os.writev(fd, batch)
        # consume what was written; a short write leaves a partial view to retry
        for v in batch:
            if written >= len(v):
                written -= len(v)
                i += 1
            else:
                views[i] = v[written:]
                break
    return total


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _open_in_place(path: Path) -> int:
    """A descriptor for overwriting the regular file at ``path`` (never through a symbolic
    link), -1 where there is none; a file with other links is removed (-1: the caller creates
    a new one)."""
    flags = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:  # the recycled step's directory where this step has a file
        shutil.rmtree(path)
        return -1
    except OSError:  # absent, a link (ELOOP), a FIFO with no reader: made anew
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return -1
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        os.unlink(path)
        return -1
    os.set_blocking(fd, True)
    return fd


def _write_copying(fd: int, pieces: Sequence[Buffer] | Stream, copy_to: Any, fsync: bool) -> int:
    import numpy as np

    total = nbytes_of(pieces)
    if copy_to.size != total:
        raise CkptError(f"internal: {total} bytes to write, a copy buffer of {copy_to.size}")
    at = start = 0
    for batch in _batches(pieces):
        for piece in batch:
            n = len(memoryview(piece).cast("B"))
            copy_to[at : at + n] = np.frombuffer(piece, np.uint8)
            at += n
            if at - start >= COPY_BATCH or at == total:
                view = memoryview(copy_to[start:at])
                while view:
                    view = view[os.write(fd, view) :]
                start = at
    if fsync:
        os.fsync(fd)
    return total


def read_scatter(fd: int, buffers: Sequence[memoryview], offset: int) -> None:
    """Fill ``buffers`` in order from ``fd`` starting at ``offset``; short file -> EOFError."""
    views = [b for b in buffers if len(b)]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got == 0:
            raise EOFError
        offset += got
        for v in batch:
            if got >= len(v):
                got -= len(v)
                i += 1
            else:
                views[i] = v[got:]
                break


def doc_bytes(doc: Any) -> bytes:
    """The bytes :func:`write_json` writes for ``doc``."""
    return json.dumps(doc, allow_nan=False, indent=1).encode("utf-8")


def write_json(path: Path, doc: Any, fsync: bool = True) -> None:
    """A metadata document, as ``codecs.zarr_meta.doc_bytes`` gives its bytes."""
    write_gather(path, [doc_bytes(doc)], fsync)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReadHandle(Protocol):
    """One open file of a checkpoint, read at offsets: a local file's descriptor
    (:class:`FileHandle`), or an object in a bucket read with ranged GETs
    (``storage.objects.source``). Closed by :meth:`close` or by leaving a ``with`` block.

    ``read_batch``: the bytes a reader should ask for at once when it reads many chunks of a
    file in order: 0 for a local file (chunk by chunk, each CRC computed while the chunk is
    still in cache), large for an object (one request per many chunks: a request costs a
    round trip, a syscall does not)."""

    read_batch: int

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        ...

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        """Fill ``views`` in order with the bytes from ``offset`` on; :class:`EOFError` when
        the file ends first."""
        ...

    def prefetch(self) -> None:
        """Fetch the whole file now, in one request, for a reader about to read most of it;
        later reads are served from what it fetched. Nothing for a local file (whose reads
        cost no round trip); a reader calls it only when ``read_batch`` holds the file."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> ReadHandle: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class ClosedOnExit:
    """``with handle:`` closes the handle at the block's end (the handles' shared mix-in)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class FileHandle(ClosedOnExit):
    """A :class:`ReadHandle` over a local file's descriptor (``os.pread`` / ``os.preadv``);
    it owns the descriptor and closes it once."""

    __slots__ = ("fd",)
    read_batch = 0

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def read_into(self, views: Sequence[memoryview], offset: int) -> None:
        read_scatter(self.fd, views, offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def prefetch(self) -> None:
        pass

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


@runtime_checkable
class Files(Protocol):
    """Where the readers (``format.shard_read``, ``format.chunk_reads``, ``container.reader``)
    get one checkpoint's files: a local directory (:class:`Inside`) or a committed checkpoint
    in a bucket (``storage.objects.source.ObjectInside``). Paths are relative to the
    checkpoint's root, as the manifest names them."""

    reads_in_flight: int
    """How many reads a reader of many files should keep going at once: 1 for a local
    directory (a read costs a system call, and the disk's own queue is ``ReadOptions.threads``),
    more for a bucket (each read waits a round trip: one at a time, hundreds of ``zarr.json``
    documents take hundreds of round trips)."""

    reads_parts: bool
    """Whether a reader that wants part of a file (``ckptfmt.open``'s indexing) reads only that
    part: True for an object in a bucket (a ranged GET of the shard index, then of the inner
    chunks needed), False for a local file (read whole in one system call, every CRC checked)."""

    @property
    def root(self) -> os.PathLike[str] | str:
        """Where the checkpoint is (its directory, or its URL): for messages and logs."""
        ...

    def read(self, rel: str, limit: int) -> bytes:
        """Up to ``limit`` bytes of ``rel``; FileNotFoundError when it is absent."""
        ...

    def open_exact(self, rel: str, size: int, tensors: Sequence[str] = ()) -> ReadHandle:
        """``rel``, which must hold ``size`` bytes, opened for reading;
        :class:`MissingFileError` / :class:`SizeMismatchError` otherwise."""
        ...

    def check_size(self, rel: str, size: int, tensors: tuple[str, ...] = ()) -> None:
        """Raise a DamagedError unless ``rel`` holds ``size`` bytes."""
        ...

    def presence_checks(
        self, read: AbstractSet[str], rank: int, ranks: int
    ) -> list[Callable[[], None]]:
        """Checks a collective load runs beside its reads, each raising a DamagedError: that
        the files of the checkpoint no rank's reads touch (``read``: the paths every rank's
        reads cover, the same on every rank) are there whole, this rank's share of ``ranks``.
        None where opening the checkpoint checked every file already, or where a missing file
        that nobody reads does not matter (a local directory)."""
        ...


_Item = TypeVar("_Item")
_Result = TypeVar("_Result")
_Params = ParamSpec("_Params")


@contextlib.contextmanager
def naming(src: Files) -> Iterator[None]:
    """Every :class:`DamagedError` raised in the block names the checkpoint ``src`` reads (its
    ``root``; :meth:`DamagedError.in_checkpoint`): a damaged file is reported as
    ``/ckpt/step-100: model/w/c/0/0: ...``, not relative to a checkpoint the message does not
    name."""
    try:
        yield
    except DamagedError as exc:
        exc.in_checkpoint(src.root)
        raise


def naming_checkpoint(fn: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """``fn``, a reader whose first argument is the :class:`Files` it reads, made to name that
    checkpoint in every :class:`DamagedError` it raises (:func:`naming`)."""

    @functools.wraps(fn)
    def reading(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        with naming(args[0]):  # type: ignore[arg-type]
            return fn(*args, **kwargs)

    return reading


def each_in_flight(
    src: Files, fn: Callable[[_Item], _Result], items: Sequence[_Item]
) -> Iterator[_Result]:
    """``fn`` of each of ``items``, yielded in their order, ``src.reads_in_flight`` running at
    once: a reader of many files in a bucket waits for their round trips together, not one
    after another; for a local directory, one after another in this thread. The first
    exception raised by ``fn``, in the items' order, is raised here (the others still run)."""
    n = min(src.reads_in_flight, len(items))
    if n <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(n) as pool:
        yield from pool.map(fn, items)


def link_out_of(root: Path, path: Path) -> tuple[Path, str] | None:
    """The first directory on the way from ``root`` to the file ``path`` (``root / rel``) that
    resolves outside ``root`` (a symbolic link, or under one), with where it leads; None when
    every one that exists stays inside. What a writer into a checkpoint checks before writing
    a file there, as :class:`Inside` does before reading one."""
    base = os.path.realpath(root)

    def inside(p: Path) -> bool:
        real = os.path.realpath(p)
        return real == base or real.startswith(base + os.sep)

    if inside(path.parent):
        return None
    probe = root
    for part in path.parent.relative_to(root).parts:
        probe = probe / part
        if not inside(probe):
            return probe, os.path.realpath(probe)
    return path.parent, os.path.realpath(path.parent)  # pragma: no cover - root itself moved


class Inside:
    """Opens files of one checkpoint for reading, refusing any that resolve outside its root.

    The manifest's paths are already checked to be shard keys (no '..', not absolute), but the
    tree itself may hold symbolic links; a link that leads out of the checkpoint is treated as a
    missing file. Each directory is checked once, with one ``lstat`` when its parent is known to be
    inside (a symbolic link is resolved in full); the file itself is opened with O_NOFOLLOW.
    """

    reads_in_flight = 1
    reads_parts = False

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self._dirs: dict[str, bool] = {"": True}

    def _dir_ok(self, rel_dir: str) -> bool:
        ok = self._dirs.get(rel_dir)
        if ok is None:
            parent = rel_dir.rsplit("/", 1)[0] if "/" in rel_dir else ""
            ok = self._dir_ok(parent)
            if ok:
                try:
                    st = os.lstat(self.root / rel_dir)
                except OSError:
                    st = None
                if st is not None and stat.S_ISLNK(st.st_mode):
                    real = os.path.realpath(self.root / rel_dir)
                    ok = real == str(self.root) or real.startswith(str(self.root) + os.sep)
            self._dirs[rel_dir] = ok
        return ok

    def open_fd(self, rel: str) -> int:
        """An O_RDONLY descriptor of ``rel``, a regular file; FileNotFoundError if it is absent
        or leads outside, :class:`NotRegularFileError` (a FileNotFoundError too) if something
        else is there: a symbolic link, a FIFO, a device, a directory.

        Opened with O_NOFOLLOW (a link is never followed) and O_NONBLOCK (opening a FIFO would
        block until a writer appears; a device might block too), then ``fstat`` must show a
        regular file, for which O_NONBLOCK means nothing (it is cleared all the same)."""
        rel_dir = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if not self._dir_ok(rel_dir):
            raise FileNotFoundError(rel)
        flags = (
            os.O_RDONLY
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
            | getattr(os, "O_NONBLOCK", 0)
            | getattr(os, "O_NOCTTY", 0)
        )
        try:
            fd = os.open(self.root / rel, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegularFileError(rel, "a symbolic link") from None
            if exc.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing
                raise NotRegularFileError(rel, "a socket or FIFO") from None
            if exc.errno in (errno.ENOTDIR, errno.EISDIR):
                raise FileNotFoundError(rel) from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a FIFO, device or directory where a file belongs
            os.close(fd)
            raise NotRegularFileError(rel, _kind_of(mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return fd

    def open_exact(self, rel: str, size: int, tensors: Sequence[str] = ()) -> FileHandle:
        """``rel``, which must be a regular file of ``size`` bytes, open for reading (a
        :class:`FileHandle`): :class:`MissingFileError` / :class:`SizeMismatchError` otherwise
        (nothing left open)."""
        try:
            fd = self.open_fd(rel)
        except NotRegularFileError as exc:
            raise NotRegularFileError(rel, exc.what, tensors).in_checkpoint(self.root) from None
        except FileNotFoundError:
            raise MissingFileError(rel, tensors).in_checkpoint(self.root) from None
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise SizeMismatchError(rel, size, actual, tensors).in_checkpoint(self.root)
        return FileHandle(fd)

    def presence_checks(
        self, read: AbstractSet[str], rank: int, ranks: int
    ) -> list[Callable[[], None]]:
        """None: a directory holds no list of what it should hold beyond the manifest, whose
        files the load reads (a level-1 copy is checked by its reads, a missing file it does not
        read changes nothing that is loaded)."""
        return []

    def check_size(self, rel: str, size: int, tensors: tuple[str, ...] = ()) -> None:
        """Raise a DamagedError unless ``rel`` is a regular file of ``size`` bytes."""
        rel_dir = rel.rsplit("/", 1)[0] if "/" in rel else ""
        try:
            st = os.lstat(self.root / rel) if self._dir_ok(rel_dir) else None
        except OSError:
            st = None
        if st is None:
            raise MissingFileError(rel, tensors).in_checkpoint(self.root)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(rel, _kind_of(st.st_mode), tensors).in_checkpoint(self.root)
        actual = st.st_size
        if actual != size:
            raise SizeMismatchError(rel, size, actual, tensors).in_checkpoint(self.root)

    def read(self, rel: str, limit: int) -> bytes:
        """Up to ``limit`` bytes of ``rel`` (FileNotFoundError as for :meth:`open_fd`)."""
        fd = self.open_fd(rel)
        try:
            # never ask for more than the file holds (+1 to see that it is longer than expected):
            # a hostile manifest may claim any size, and a read buffer is allocated up front
            want = min(limit, os.fstat(fd).st_size + 1)
            first = os.read(fd, want)
            if len(first) == want or not first:
                return first
            parts = [first]  # a short read (rare for regular files): go on to the end
            got = len(first)
            while got < want:
                more = os.read(fd, want - got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            return b"".join(parts)
        finally:
            os.close(fd)


def _kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"
