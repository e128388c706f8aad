"""Reading an export's tensors (``ckptfmt export``): each read whole at its global shape, in
the order the output is written, a bounded window ahead of the writer on a thread pool
(:class:`ReadAhead`), and cast when asked (:func:`cast_array`). Shared by the writers of a
directory (``export``) and of a bucket (``export_bucket``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ckptfmt.dtypes import by_name
from ckptfmt.maintenance.source import Source
from ckptfmt.manifest.model import TensorEntry


class ReadAhead:
    """Tensors read in order on a thread pool, up to ``window`` bytes ahead of the consumer
    (always at least the next tensor, however large). ``dest(k)`` gives tensor ``k``'s
    destination (None: a new array) and ``done(k)`` releases it once consumed."""

    def __init__(
        self,
        source: Source,
        order: Sequence[TensorEntry],
        pool: ThreadPoolExecutor,
        window: int,
        dest: Callable[[int], Callable[[], np.ndarray] | None] | None = None,
    ) -> None:
        self.source, self.order, self.pool, self.window = source, order, pool, window
        self.dest = dest
        self.next = 0
        self.inflight = 0
        self.queue: deque[tuple[int, np.ndarray, list[Future[None]]]] = deque()
        self.bytes_read = 0

    def _fill(self) -> None:
        while self.next < len(self.order):
            t = self.order[self.next]
            nb = t.size * by_name(t.dtype).itemsize
            if self.queue and self.inflight + nb > self.window:
                return
            into = self.dest(self.next) if self.dest is not None else None
            out, jobs = self.source.tensor_reads(t, into)
            self.queue.append((self.next, out, [self.pool.submit(j) for j in jobs]))
            self.inflight += nb
            self.bytes_read += sum(f.size for r in t.regions for f in r.files)
            self.next += 1

    def take(self) -> np.ndarray:
        """The next tensor, read and checked."""
        self._fill()
        _, out, futures = self.queue.popleft()
        for f in futures:
            f.result()  # the first damage found is raised
        self.inflight -= out.nbytes
        self._fill()
        return out

    def cancel(self) -> None:
        for _, _, futures in self.queue:
            for f in futures:
                f.cancel()
        for _, _, futures in self.queue:
            for f in futures:
                if not f.cancelled():
                    f.exception()  # wait: no reader may still be writing into a buffer
        self.queue.clear()


def cast_array(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` as ``dtype``, rounded to nearest even and out-of-range values to infinity, as
    ``torch.Tensor.to`` does (so no overflow warning: it is what a cast means)."""
    target = by_name(dtype).numpy
    if a.dtype == target:
        return a
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(target)
