"""A key prefix in an object store (S3, GCS, Azure), and the few requests ckptfmt makes there.

:class:`Bucket` is the only place the object-store library (obstore, the Rust ``object_store``
crate's bindings; the ``cloud`` extra) is called; it is imported on first use, so the core imports
without it and a URL user without it is told what to install (:class:`CloudNotInstalledError`).

Retries and timeouts are the library's own, set explicitly (:class:`Retries`): a failed request
is retried with exponential backoff and jitter on a 5xx answer (S3's ``503 SlowDown`` included),
a connection refused or dropped (also in the middle of a PUT body: object_store marks its plain
PUTs and multipart parts idempotent and re-sends them whole) and a timeout, up to
``max_retries`` times and never past ``retry_timeout`` after the first try; a multipart upload
retries each part on its own. A conditional put (``create_only``, ``if_match``) whose request
went out is *not* re-sent after a dropped connection, since it may have acted: its caller reads
the object back (:func:`.commit.write_commit`, :func:`.commit.move_latest` do). What still
fails raises :class:`ObjectStoreError` naming the key's URL, the request and the HTTP status,
so no request waits longer than about ``retry_timeout + timeout``. A first contact that fails
(:func:`translate`) raises an :class:`ObjectStoreSetupError` naming the bucket, the endpoint and
what to set: :class:`BucketNotFoundError`, :class:`CredentialsError` (missing, refused,
expired, not allowed), :class:`HttpNotAllowedError`, or the wrong region.

Settings come, highest first, from ``storage_options`` (keys as obstore and fsspec spell them:
``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``, ``region``,
``endpoint_url``/``endpoint``, ``allow_http``; s3fs's ``key``, ``secret``, ``token``,
``region_name`` for S3 only: a ``gs://`` or ``az://`` URL given one is told its store's own keys,
but for Azure's ``token``, its bearer token; and the retry keys of :class:`Retries`), then from
the standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``; ``GOOGLE_*`` and ``AZURE_*`` for the
other stores), read by obstore itself. ``gs://`` and ``az://`` URLs go through the same library
unchanged; the tests cover S3 only (no local emulator of those stores with conditional writes).
"""

from __future__ import annotations

import builtins
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptfmt.checksum import crc32c
from ckptfmt.errors import (
    BucketNotFoundError,
    CloudNotInstalledError,
    CredentialsError,
    DestinationExistsError,
    HttpNotAllowedError,
    MissingFileError,
    ObjectStoreError,
    ObjectStoreSetupError,
    StorageError,
    UsageError,
)
from ckptfmt.storage.objects import clouds
from ckptfmt.storage.objects.url import join_key, split_url

MULTIPART_ABOVE = 16 << 20
"""Objects larger than this are uploaded in parts: below it, one PUT is as fast and cheaper."""
MIN_PART = 8 << 20
"""The smallest part size (S3 allows 5 MiB; 8 MiB parts keep the request count low)."""
MAX_PARTS = 9000
"""Parts per object at most (S3 allows 10,000): the part size grows with the file to stay under."""
UPLOAD_CONCURRENCY = 8
"""Parts of one object in flight at once; memory held is about this many parts."""
COPY_MAX = 5 << 30
"""The largest object S3 copies in one request (``CopyObject``); larger ones are uploaded."""
DELETE_BATCH = 1000
"""Keys per bulk delete request (S3's DeleteObjects limit)."""

# keys of obstore's ClientConfig: they go to ``client_options``, never to the store's config
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
# fsspec/boto3 spellings -> object_store's
_ALIASES = {
    "endpoint_url": "endpoint",
    "aws_endpoint_url": "endpoint",
    "aws_endpoint": "endpoint",
    "aws_region": "region",
    "aws_allow_http": "allow_http",
}
# s3fs's spellings of AWS settings: S3's only (another store given them is told its own keys)
_S3FS_ALIASES = {
    "region_name": "region",
    "key": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "token": "aws_session_token",
}
_GOOGLE_CREDENTIALS = (
    "give its credentials as service_account (a service account's JSON key file), "
    "service_account_key (the key itself), bearer_token (an OAuth token), "
    "or skip_signature=true for a public bucket"
)
_AZURE_CREDENTIALS = (
    "give its credentials as account_key (the storage account's key, with account_name), "
    "sas_key (a shared access signature), token (a bearer token), "
    "or a service principal's client_id, client_secret and tenant_id"
)
# what each of those aliases is instead, for the other stores (None: passed on unchanged, the
# store's own key of the same name)
_S3FS_ELSEWHERE: dict[str, dict[str, str | None]] = {
    "gs": {
        "key": _GOOGLE_CREDENTIALS,
        "secret": _GOOGLE_CREDENTIALS,
        "token": _GOOGLE_CREDENTIALS,
        "region_name": "it has no region setting (a bucket's location is its own): leave it out",
    },
    "az": {
        "key": _AZURE_CREDENTIALS,
        "secret": _AZURE_CREDENTIALS,
        "token": None,
        "region_name": "it has no region setting (the storage account says where): leave it out",
    },
}
# client settings the environment gives for each scheme: obstore reads them from the environment
# only when it is given no client options, and ckptfmt always gives some (the timeouts)
_CLIENT_ENV = {
    "s3": "AWS_",
    "s3a": "AWS_",
    "gs": "GOOGLE_",
    "az": "AZURE_",
    "abfs": "AZURE_",
    "abfss": "AZURE_",
    "azure": "AZURE_",
}
_STATUS = re.compile(r"status(?: code)?:? (\d{3})")


def _alias(url: str, scheme: str, key: str) -> str:
    """The store's own spelling of the storage option ``key`` (lower-cased). s3fs's ``key``,
    ``secret``, ``token`` and ``region_name`` are AWS settings: a Google or Azure URL given
    one of them gets a :class:`UsageError` naming that store's keys, except Azure's ``token``,
    its own key (a bearer token)."""
    family = "gs" if scheme in clouds.GOOGLE else "az" if scheme in clouds.AZURE else None
    if key in _S3FS_ALIASES and family is not None:
        instead = _S3FS_ELSEWHERE[family][key]
        if instead is None:
            return key
        aws = _S3FS_ALIASES[key] if _S3FS_ALIASES[key].startswith("aws_") else "aws_region"
        raise UsageError(
            f"{url!r}: storage option {key!r} is s3fs's spelling of the S3 setting "
            f"{aws}, which {scheme}:// does not take: {instead}"
        )
    return _ALIASES.get(key) or _S3FS_ALIASES.get(key) or key


@dataclass(frozen=True)
class Retries:
    """How long to insist: the library's retry and timeout settings, in seconds.

    ``max_retries`` retries of one request at most, backing off from ``init_backoff`` (doubling,
    with jitter) up to ``max_backoff``; none started later than ``retry_timeout`` after the first
    try. ``connect_timeout`` bounds a connection's setup, ``timeout`` one request whole (a part of
    a multipart upload is one request; a whole-object GET of a large shard too, hence generous),
    ``read_timeout`` a stall while an answer is read (a dead connection found long before
    ``timeout``). Each may also be given in ``storage_options`` under its
    own name (a number of seconds, as text or number)."""

    max_retries: int = 10
    init_backoff: float = 0.05
    max_backoff: float = 5.0
    retry_timeout: float = 90.0
    connect_timeout: float = 5.0
    timeout: float = 120.0
    read_timeout: float = 30.0

    def retry_config(self) -> dict[str, Any]:
        return {
            "max_retries": self.max_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout),
            "backoff": {
                "init_backoff": timedelta(seconds=self.init_backoff),
                "max_backoff": timedelta(seconds=self.max_backoff),
                "base": 2,
            },
        }

    def client_options(self) -> dict[str, Any]:
        return {
            "connect_timeout": timedelta(seconds=self.connect_timeout),
            "timeout": timedelta(seconds=self.timeout),
            "read_timeout": timedelta(seconds=self.read_timeout),
        }


_RETRY_KEYS = frozenset(f.name for f in fields(Retries))


def _obstore() -> Any:
    try:
        import obstore
        import obstore.store
    except ImportError:
        return None
    return obstore


def part_size(size: int) -> int:
    """The part size for an object of ``size`` bytes: at least :data:`MIN_PART`, large enough
    that no object needs more than :data:`MAX_PARTS` parts."""
    return max(MIN_PART, -(-size // MAX_PARTS))


class Bucket:
    """A key prefix in an object store: ``s3://bucket/run/ckpt`` holds keys ``a/b`` as
    ``run/ckpt/a/b``. Every key argument is relative to the prefix.

    ``requests`` counts the requests made, by kind (``"PUT"``, ``"GET"``, ``"HEAD"``, ``"LIST"``,
    ``"DELETE"``, ``"COPY"``), shared with every :meth:`child`; a multipart upload counts its
    parts plus two (start and completion, billed as PUTs by S3), a bulk delete one per 1000
    keys; retries made by the library are not seen here. Safe to use from several threads."""

    def __init__(self, store: Any, scheme: str, bucket: str, prefix: str, retries: Retries) -> None:
        self._store = store
        self.scheme = scheme
        self.bucket = bucket
        self.prefix = prefix
        self.retries = retries
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.options: dict[str, Any] = {}
        """The store settings given in ``storage_options`` (object_store's key names), for
        another client of the same store (gc's boto3)."""
        self.endpoint: str | None = None
        """The endpoint the client talks to when one is set (``storage_options`` or the
        environment), None for the store's default: errors about the setup name it."""

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def at(
        cls,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: Retries | None = None,
    ) -> Bucket:
        """The bucket prefix at ``url`` (``s3://bucket/run/ckpt``). ``storage_options``
        override the environment (see the module's docstring); ``retries`` the default
        :class:`Retries`, and retry keys in ``storage_options`` override both. Makes no
        request. Raises :class:`CloudNotInstalledError` without the ``cloud`` extra,
        :class:`UsageError` for a URL or option the library refuses; for S3, what the settings
        alone show will fail, before a request: :class:`HttpNotAllowedError` for a plain
        ``http://`` endpoint without ``allow_http``, :class:`CredentialsError` when nothing says
        where credentials come from and the endpoint is not AWS's (whose instances may have a
        role; another store has none to give)."""
        scheme, bucket, prefix = split_url(url)
        obstore = _obstore()
        if obstore is None:
            raise CloudNotInstalledError(url)
        from_url: Any = obstore.store.from_url

        config: dict[str, Any] = {}
        client: dict[str, Any] = {}
        tuned: dict[str, Any] = {}  # Retries fields
        env_prefix = _CLIENT_ENV.get(scheme)
        if env_prefix is not None:  # see _CLIENT_ENV
            for key in _CLIENT_KEYS:
                value = os.environ.get(env_prefix + key.upper())
                if value is not None:
                    client[key] = value
        for raw, value in (storage_options or {}).items():
            key = _alias(url, scheme, raw.lower())
            if key in _RETRY_KEYS:
                tuned[key] = value
            elif key in _CLIENT_KEYS:
                client[key] = value
            elif value is not None:
                config[key] = value
        try:
            numbers: dict[str, Any] = {k: _number(k, v) for k, v in tuned.items()}
            policy = replace(retries or Retries(), **numbers)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{url!r}: storage option {exc}") from None
        client.update(policy.client_options())
        for key in ("allow_http", "allow_invalid_certificates"):
            if isinstance(client.get(key), str):
                client[key] = client[key].strip().lower() in ("1", "true", "yes", "on")
        client["allow_http"] = bool(client.get("allow_http", False))
        endpoint = None
        if scheme in ("s3", "s3a"):  # obstore's S3 config spells every key with aws_
            config = {k if k.startswith("aws_") else f"aws_{k}": v for k, v in config.items()}
            endpoint = _s3_endpoint(config)
            where = f"{scheme}://{bucket}"
            if endpoint and endpoint.lower().startswith("http://") and not client["allow_http"]:
                raise _http_refused(url, where, "SETUP", endpoint)
            if not _s3_credentials_set(config) and not _aws_endpoint(endpoint):
                raise _no_credentials(url, where, "SETUP", endpoint, "none are set")
        root = f"{scheme}://{bucket}" if bucket else f"{scheme}:///"
        try:
            store = (
                from_url(root)  # in-process, for tests: takes no client or retry settings
                if scheme == "memory"
                else from_url(
                    root,
                    config=config or None,
                    client_options=client,
                    retry_config=policy.retry_config(),
                )
            )
        except BaseException as exc:  # obstore raises its own errors, and panics on bad keys
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if scheme in clouds.AZURE and "Account must be specified" in str(exc):
                raise clouds.no_account(url, f"{scheme}://{bucket}") from None
            raise UsageError(
                f"{url!r}: the object store cannot be set up with these options "
                f"({sorted(storage_options or {})}): {_first_line(exc)}"
            ) from None
        made = cls(store, scheme, bucket, prefix, policy)
        made.options = config
        made.endpoint = endpoint
        return made

    def child(self, rel: str) -> Bucket:
        """The deeper prefix ``rel`` of this one (same client, same request counter)."""
        sub = Bucket(
            self._store, self.scheme, self.bucket, join_key(self.prefix, rel), self.retries
        )
        sub.requests = self.requests
        sub._lock = self._lock
        sub.options = self.options
        sub.endpoint = self.endpoint
        return sub

    def relocated(self, prefix: str) -> Bucket:
        """The prefix ``prefix`` (from the bucket's root) of the same bucket, on this client
        and request counter: another checkpoint of the store, e.g. an incremental save's base."""
        sub = self.child("")
        sub.prefix = prefix.strip("/")
        return sub

    @property
    def url(self) -> str:
        """The URL of the prefix (``s3://bucket/run/ckpt``)."""
        return self.key_url("")

    def key_url(self, key: str) -> str:
        """The URL of ``key`` (errors and messages name keys by it)."""
        full = join_key(self.prefix, key)
        return f"{self.scheme}://{self.bucket}/{full}" if full else f"{self.scheme}://{self.bucket}"

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    # --- requests -------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The whole object ``key``. Raises :class:`MissingFileError` when it is absent."""
        return bytes(self.get_tagged(key)[0])

    def get_tagged(self, key: str) -> tuple[bytes, str | None]:
        """The whole object ``key`` and its etag (for a following ``put(if_match=...)``)."""
        obstore = self._lib()
        with self._failing("GET", key):
            self._count("GET")
            result = obstore.get(self._store, self._full(key))
            data = bytes(result.bytes())
            return data, result.meta.get("e_tag")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from offset ``start`` (one ranged GET); fewer only where
        the object ends before."""
        return self.get_range_sized(key, start, length)[0]

    def get_range_sized(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        """:meth:`get_range`, and the size of the whole object, which the answer to a ranged
        GET states (``Content-Range``): a reader of part of an object learns its size without
        a HEAD. ``length`` 0 asks for nothing and gives size -1."""
        if length <= 0:
            return b"", -1
        data, size = self._ranged(key, start, length)
        return bytes(data), size

    def get_view(self, key: str) -> memoryview:
        """The whole object ``key`` (one GET) as a read-only view of the library's own buffer:
        no copy, for a reader that verifies and places the bytes itself. Raises
        :class:`MissingFileError` when it is absent."""
        obstore = self._lib()
        with self._failing("GET", key):
            self._count("GET")
            return memoryview(obstore.get(self._store, self._full(key)).bytes())

    def read_into(self, key: str, offset: int, views: Sequence[memoryview]) -> tuple[int, int]:
        """Fill ``views``, in order, with the bytes of ``key`` from ``offset`` on, in one ranged
        GET; returns the bytes filled (less than the views hold where the object ends early)
        and the size of the whole object (-1 when the views hold nothing)."""
        total = sum(v.nbytes for v in views)
        if total == 0:
            return 0, -1
        data, size = self._ranged(key, offset, total)
        pos = 0
        for view in views:
            n = min(view.nbytes, len(data) - pos)
            if n <= 0:
                break
            view.cast("B")[:n] = data[pos : pos + n]
            pos += n
        return pos, size

    def _ranged(self, key: str, start: int, length: int) -> tuple[memoryview, int]:
        obstore = self._lib()
        with self._failing("GET", key):
            self._count("GET")
            got = obstore.get(
                self._store, self._full(key), options={"range": (start, start + length)}
            )
            return memoryview(got.bytes()), int(got.meta["size"])

    def head(self, key: str) -> int | None:
        """The size of ``key``, None when there is no such object."""
        meta = self.stat(key)
        return None if meta is None else meta[0]

    def stat(self, key: str) -> tuple[int, str | None] | None:
        """``(size, etag)`` of ``key``, None when there is no such object."""
        obstore = self._lib()
        try:
            with self._failing("HEAD", key):
                self._count("HEAD")
                meta = obstore.head(self._store, self._full(key))
        except MissingFileError:
            return None
        return int(meta["size"]), meta.get("e_tag")

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> str:
        """Write ``data`` at ``key`` in one PUT; return the new etag. ``create_only``: fail with
        :class:`DestinationExistsError` when the key exists (``If-None-Match: *``);
        ``if_match``: replace only the object of that etag, else :class:`ObjectStoreError` with
        status 412."""
        if create_only and if_match is not None:
            raise UsageError("put: create_only and if_match exclude each other")
        mode: Any = "create" if create_only else ({"e_tag": if_match} if if_match else None)
        obstore = self._lib()
        with self._failing("PUT", key):
            self._count("PUT")
            result = obstore.put(self._store, self._full(key), data, mode=mode, use_multipart=False)
        return str(result.get("e_tag") or "")

    def upload(self, key: str, path: Path, *, size: int | None = None) -> int:
        """Upload the file at ``path`` to ``key`` and return the CRC32C of its bytes. Files above
        :data:`MULTIPART_ABOVE` go in parts of :func:`part_size` (< 10,000 parts), at most
        :data:`UPLOAD_CONCURRENCY` in flight; the file is streamed, never read whole into
        memory, and its CRC32C computed from the same reads. ``size``: the file's size when the
        caller knows it (saves a stat)."""
        obstore = self._lib()
        nbytes = os.stat(path).st_size if size is None else size
        if nbytes <= MULTIPART_ABOVE:
            data = Path(path).read_bytes()
            with self._failing("PUT", key):
                self._count("PUT")
                obstore.put(self._store, self._full(key), data, use_multipart=False)
            return crc32c(data)
        chunk = part_size(nbytes)
        crc = _Crc()
        with open(path, "rb") as f, self._failing("PUT", key):
            self._count("PUT", 2 + -(-nbytes // chunk))
            obstore.put(
                self._store,
                self._full(key),
                crc.chunks(f, chunk),
                use_multipart=True,
                chunk_size=chunk,
                max_concurrency=UPLOAD_CONCURRENCY,
            )
        if crc.nbytes != nbytes:
            raise ObjectStoreError(
                self.key_url(key),
                "PUT",
                None,
                f"{path} changed while it was uploaded ({nbytes} bytes, then {crc.nbytes})",
            )
        return crc.value

    def upload_parts(self, key: str, parts: Iterable[bytes], size: int) -> None:
        """Upload ``size`` bytes handed out as ``parts`` (each :func:`part_size` long but the
        last) to ``key`` in a multipart upload, :data:`UPLOAD_CONCURRENCY` parts in flight:
        the bytes are never held whole (a writer streaming from memory, not from a file)."""
        obstore = self._lib()
        chunk = part_size(size)
        with self._failing("PUT", key):
            self._count("PUT", 2 + -(-size // chunk))
            obstore.put(
                self._store,
                self._full(key),
                iter(parts),
                use_multipart=True,
                chunk_size=chunk,
                max_concurrency=UPLOAD_CONCURRENCY,
            )

    def download(self, key: str, path: Path) -> int:
        """Write object ``key`` to the file ``path`` (through a temporary name beside it,
        renamed when whole), streaming; return the CRC32C of its bytes."""
        obstore = self._lib()
        path = Path(path)
        tmp = path.with_name(f".{path.name}.part-{os.getpid()}-{threading.get_ident()}")
        crc = 0
        try:
            with open(tmp, "wb") as f, self._failing("GET", key):
                self._count("GET")
                result = obstore.get(self._store, self._full(key))
                for piece in result.stream(min_chunk_size=8 << 20):
                    _write(f, piece, tmp)
                    crc = crc32c(piece, crc)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return crc

    def copy_object(self, src_key: str, dst_key: str, *, source: Bucket | None = None) -> None:
        """Copy the object ``src_key`` of ``source`` (default: this prefix) to ``dst_key`` here,
        inside the store (S3 ``CopyObject``: no byte passes through this process; one request,
        counted as ``"COPY"``). Both prefixes must be in the same bucket of the same store
        (:class:`UsageError` otherwise: a copy between stores is a download and an upload).
        Raises :class:`MissingFileError` when ``src_key`` is absent. S3 copies up to
        :data:`COPY_MAX` bytes in one request; a caller with a bigger object uploads it."""
        src = source if source is not None else self
        if (src.scheme, src.bucket) != (self.scheme, self.bucket):
            raise UsageError(
                f"cannot copy {src.key_url(src_key)} to {self.key_url(dst_key)} inside the "
                "store: they are in different buckets"
            )
        obstore = self._lib()
        with src._failing("COPY", src_key):
            self._count("COPY")
            obstore.copy(self._store, src._full(src_key), self._full(dst_key), overwrite=True)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (bulk requests; an absent key is no error)."""
        names = [self._full(k) for k in keys]
        obstore = self._lib()
        for i in range(0, len(names), DELETE_BATCH):
            batch = names[i : i + DELETE_BATCH]
            with self._failing("DELETE", self._rel(batch[0])):
                self._count("DELETE")
                obstore.delete(self._store, batch)

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix`` (whole path segments: ``a`` holds
        ``a/x``, not ``ab``), keys relative to this bucket prefix, sorted."""
        obstore = self._lib()
        out: list[tuple[str, int]] = []
        with self._failing("LIST", prefix):
            self._count("LIST")
            for page in obstore.list(self._store, self._full(prefix) or None, chunk_size=1000):
                out += [(self._rel(m["path"]), int(m["size"])) for m in page]
        return sorted(out)

    def list_meta(self, prefix: str = "") -> builtins.list[tuple[str, int, float]]:
        """``(key, size, last modified as a POSIX time)`` of every object under ``prefix``,
        as :meth:`list`."""
        obstore = self._lib()
        out: builtins.list[tuple[str, int, float]] = []
        with self._failing("LIST", prefix):
            self._count("LIST")
            for page in obstore.list(self._store, self._full(prefix) or None, chunk_size=1000):
                out += [
                    (self._rel(m["path"]), int(m["size"]), m["last_modified"].timestamp())
                    for m in page
                ]
        return sorted(out)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """The names of the "directories" right under ``prefix`` (a LIST with delimiter ``/``):
        ``["step-00000100", ...]``, sorted."""
        obstore = self._lib()
        with self._failing("LIST", prefix):
            self._count("LIST")
            result = obstore.list_with_delimiter(self._store, self._full(prefix) or None)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"])

    # --- plumbing -------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _rel(self, full: str) -> str:
        if self.prefix and full.startswith(self.prefix + "/"):
            return full[len(self.prefix) + 1 :]
        return full

    def _count(self, op: str, n: int = 1) -> None:
        with self._lock:
            self.requests[op] += n

    @staticmethod
    def _lib() -> Any:
        return _obstore()

    def _failing(self, op: str, key: str) -> _Failing:
        return _Failing(self, op, key)


class _Failing:
    """Turns the library's errors raised inside it into the tree's, naming the key's URL."""

    def __init__(self, bucket: Bucket, op: str, key: str) -> None:
        self.bucket, self.op, self.key = bucket, op, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not _is_library_error(exc):
            return
        raise translate(exc, self.bucket.key_url(self.key), self.op, self.bucket) from exc


def _is_library_error(exc: BaseException) -> bool:
    if type(exc).__module__.startswith("obstore"):
        return True
    # obstore raises built-in FileNotFoundError for an absent object, and built-in errors for
    # transport failures; an error of our own tree passes untouched
    return isinstance(exc, OSError | ValueError | RuntimeError) and not type(
        exc
    ).__module__.startswith("ckptfmt")


def translate(exc: BaseException, url: str, op: str, bucket: Bucket | None = None) -> Exception:
    """The tree's error for a library error met on ``url`` during ``op`` (of ``bucket``, when
    known: a setup error names its bucket and endpoint)."""
    name = type(exc).__name__
    text = str(exc)
    status = _status_of(text)
    setup = _setup_error(text, status, url, op, bucket)
    if setup is not None:
        return setup
    if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or status == 404:
        return MissingFileError(url, reason="missing: no such object")
    if name == "AlreadyExistsError":
        return DestinationExistsError(url, "an object is already there (create-only write)")
    if name == "PreconditionError":
        return ObjectStoreError(url, op, 412, "the object changed (its etag is not the one given)")
    return ObjectStoreError(url, op, status, _first_line(exc))


# --- first contact: the bucket, the endpoint, the credentials ---------------------------------

_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_S3_REGION = re.compile(r"<Region>([a-z0-9-]+)</Region>")
_REFUSED = {
    "InvalidAccessKeyId": (
        "the store knows no access key id {key}",
        "check AWS_ACCESS_KEY_ID (in Python also storage_options="
        '{"aws_access_key_id": "<key id>"}) and that the endpoint is the store the key '
        "belongs to",
    ),
    "SignatureDoesNotMatch": (
        "the secret access key does not match the access key id {key}",
        "check AWS_SECRET_ACCESS_KEY (in Python also storage_options="
        '{"aws_secret_access_key": "<secret>"})',
    ),
    "AccessDenied": (
        "the credentials (access key id {key}) may not make this request",
        "grant them s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on the "
        "bucket, or set other credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
    ),
    "InvalidToken": (
        "the session token is not valid for access key id {key}",
        "set AWS_SESSION_TOKEN to the token issued with the key, or unset it for a long-term key",
    ),
    "ExpiredToken": (
        "the session token of access key id {key} has expired",
        "renew the temporary credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN)",
    ),
}
_REGION = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed"})
_METADATA = ("/latest/api/token", "/latest/meta-data/", "169.254.169.254")
_CREDENTIAL_KEYS = (
    "aws_access_key_id",
    "aws_skip_signature",
    "aws_web_identity_token_file",
    "aws_container_credentials_relative_uri",
    "aws_container_credentials_full_uri",
    "aws_metadata_endpoint",
)
_NO_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and AWS_SESSION_TOKEN for temporary "
    'credentials (in Python also storage_options={"aws_access_key_id": "<key id>", '
    '"aws_secret_access_key": "<secret>"}), or AWS_SKIP_SIGNATURE=true for a public bucket; '
    "ckptfmt does not read ~/.aws/credentials or AWS_PROFILE"
)


def _setup_error(
    text: str, status: int | None, url: str, op: str, bucket: Bucket | None
) -> ObjectStoreSetupError | None:
    """The setup error a library error shows, or None: a missing bucket, credentials refused
    or missing (no instance role answered at the metadata endpoint), plain HTTP not allowed,
    the wrong region."""
    where = _bucket_url(url, bucket)
    endpoint = bucket.endpoint if bucket is not None else None
    scheme = where.partition("://")[0].lower()
    if scheme in clouds.GOOGLE or scheme in clouds.AZURE:  # their own settings, not AWS's
        options = bucket.options if bucket is not None else {}
        return clouds.setup_error(scheme, text, status, url, op, where, endpoint, options)
    codes = _S3_CODE.findall(text)
    code = codes[0] if codes else ""
    if code == "NoSuchBucket" or "NoSuchBucket" in text:
        name = where.split("://", 1)[-1]
        return BucketNotFoundError(
            url,
            op,
            status,
            f"no such bucket {name!r}",
            bucket=where,
            endpoint=endpoint,
            fix=f"create the bucket {name} (ckptfmt never creates one), or correct the "
            "bucket in the URL or the endpoint: AWS_ENDPOINT_URL (in Python also "
            'storage_options={"endpoint_url": "<url>"})',
        )
    # before the 403s: a metadata service without a role answers 403 too
    if any(m in text for m in _METADATA) or _metadata_endpoint_in(text, bucket):
        return _no_credentials(
            url,
            where,
            op,
            endpoint,
            "none are set, and no instance role answered at the instance-metadata endpoint",
            status,
        )
    if code in _REFUSED or (status == 403 and not code):
        what, fix = _REFUSED.get(code or "AccessDenied", _REFUSED["AccessDenied"])
        key = _access_key_id(bucket)
        if key is None:  # unsigned requests (AWS_SKIP_SIGNATURE): the bucket is not public
            what, fix = (
                "requests without credentials are refused (not a public bucket)",
                (_NO_CREDENTIALS_FIX.split(", or AWS_SKIP_SIGNATURE")[0]),
            )
        return CredentialsError(
            url,
            op,
            status,
            "credentials refused: " + what.format(key=repr(key) if key else "(none given)"),
            bucket=where,
            endpoint=endpoint,
            fix=fix,
            code=code or str(status),
        )
    if code in _REGION:
        found = _S3_REGION.findall(text)
        region = found[0] if found else "<the bucket's region>"
        return ObjectStoreSetupError(
            url,
            op,
            status,
            f"the bucket is in another region than the client's ({code})",
            bucket=where,
            endpoint=endpoint,
            fix=f"set AWS_REGION={region} (in Python also "
            f'storage_options={{"region": "{region}"}})',
        )
    if "builder error" in text and endpoint and endpoint.lower().startswith("http://"):
        return _http_refused(url, where, op, endpoint)
    return None


def _bucket_url(url: str, bucket: Bucket | None) -> str:
    if bucket is not None:
        return f"{bucket.scheme}://{bucket.bucket}"
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _access_key_id(bucket: Bucket | None) -> str | None:
    given = bucket.options.get("aws_access_key_id") if bucket is not None else None
    return str(given) if given else os.environ.get("AWS_ACCESS_KEY_ID") or None


def _metadata_endpoint_in(text: str, bucket: Bucket | None) -> bool:
    given = bucket.options.get("aws_metadata_endpoint") if bucket is not None else None
    endpoint = given or os.environ.get("AWS_METADATA_ENDPOINT")
    return bool(endpoint) and str(endpoint).rstrip("/") in text


def _s3_endpoint(config: Mapping[str, Any]) -> str | None:
    """The endpoint an S3 client of ``config`` (object_store's keys) uses: the option, else the
    environment's (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT``, as object_store reads them); None for
    AWS's own."""
    given = config.get("aws_endpoint") or config.get("aws_endpoint_url")
    if given:
        return str(given)
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or None


def _aws_endpoint(endpoint: str | None) -> bool:
    """Whether ``endpoint`` is AWS's own (None: the default), where credentials may come from
    the instance's role; another store (MinIO, Ceph, a test server) takes only keys given."""
    if endpoint is None:
        return True
    host = re.sub(r"^[a-z0-9+.-]+://", "", endpoint.lower()).split("/", 1)[0].split(":", 1)[0]
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _s3_credentials_set(config: Mapping[str, Any]) -> bool:
    """Whether anything tells the S3 client where its credentials are (keys, no signing, a web
    identity, a container's credentials, a metadata endpoint), in ``config`` or the
    environment."""
    return any(
        _set(config.get(key)) or _set(os.environ.get(key.upper())) for key in _CREDENTIAL_KEYS
    )


def _set(value: Any) -> bool:
    return value is not None and str(value).strip().lower() not in ("", "false", "0", "no", "off")


def _no_credentials(
    url: str, where: str, op: str, endpoint: str | None, why: str, status: int | None = None
) -> CredentialsError:
    return CredentialsError(
        url,
        op,
        status,
        f"no credentials: {why}",
        bucket=where,
        endpoint=endpoint,
        fix=_NO_CREDENTIALS_FIX,
        code="missing",
    )


def _http_refused(url: str, where: str, op: str, endpoint: str) -> HttpNotAllowedError:
    return HttpNotAllowedError(
        url,
        op,
        None,
        "the endpoint is plain http://, which the client refuses unless allowed",
        bucket=where,
        endpoint=endpoint,
        fix='set AWS_ALLOW_HTTP=true (in Python also storage_options={"allow_http": True}), '
        "or use an https:// endpoint",
    )


def _status_of(text: str) -> int | None:
    found = _STATUS.findall(text)
    return int(found[-1]) if found else None


def _first_line(exc: BaseException) -> str:
    """The library's message without its debug dump (a page of Rust structs)."""
    text = str(exc).split("\n\nDebug source:")[0].strip()
    text = re.sub(r"<\?xml.*", "", text, flags=re.DOTALL).strip().rstrip(":")
    return text.splitlines()[0] if text else type(exc).__name__


def _write(f: Any, piece: bytes, path: Path) -> None:
    """Write a downloaded piece; a local failure (a full disk) is the file system's error."""
    try:
        f.write(piece)
    except OSError as exc:
        raise StorageError.of(exc, str(path)) from exc


def _number(key: str, value: Any) -> float | int:
    number = float(value)
    if number < 0:
        raise ValueError(f"{key}={value!r} is negative")
    return int(number) if key == "max_retries" else number


class _Crc:
    """Reads a file in parts for an upload, computing the CRC32C of what it hands out."""

    def __init__(self) -> None:
        self.value = 0
        self.nbytes = 0

    def chunks(self, f: Any, size: int) -> Iterator[bytes]:
        while True:
            piece = f.read(size)
            if not piece:
                return
            self.value = crc32c(piece, self.value)
            self.nbytes += len(piece)
            yield piece
