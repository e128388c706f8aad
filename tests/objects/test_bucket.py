"""Bucket, against a real S3 server (and faults injected on the wire by the proxy): the requests
and what they return, multipart uploads of large files with their CRC32C, retries through 503
SlowDown bursts and dropped connections, a bounded failure naming the key when the server is
gone, settings from storage_options over the environment, and a clear error without obstore."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
from kit.s3 import S3
from kit.s3_proxy import S3Proxy

from ckptfmt.errors import (
    CloudNotInstalledError,
    DestinationExistsError,
    MissingFileError,
    ObjectStoreError,
    StorageError,
    UrlNotSupportedError,
    UsageError,
)
from ckptfmt.storage.objects import Bucket, is_url, part_size, split_url

FAST = {"retry_timeout": 3, "timeout": 3, "connect_timeout": 1, "init_backoff": 0.01}


def test_urls() -> None:
    assert split_url("s3://b/run/ckpt/") == ("s3", "b", "run/ckpt")
    assert split_url("S3://b") == ("s3", "b", "")
    assert split_url("gs://b//x") == ("gs", "b", "x")
    assert is_url("s3://b/x") and is_url("az://c/x") and not is_url("/tmp/x")
    assert not is_url("ftp://h/x") and not is_url(Path("s3://b"))
    with pytest.raises(UrlNotSupportedError):
        split_url("ftp://h/x")
    with pytest.raises(UsageError, match=r"\.\."):
        split_url("s3://b/a/../c")
    with pytest.raises(UsageError, match="no bucket"):
        split_url("s3:///x")


def test_part_size_keeps_objects_under_10000_parts() -> None:
    assert part_size(40 << 20) == 8 << 20
    for size in (1 << 30, 100 << 30, 5 << 40):
        assert -(-size // part_size(size)) <= 9000


def test_requests_and_answers(s3: S3, tmp_path: Path) -> None:
    b = Bucket.at(f"{s3.url}/run/ckpt")
    assert b.url == f"{s3.url}/run/ckpt" and b.key_url("a/k") == f"{s3.url}/run/ckpt/a/k"
    etag = b.put("a/k", b"hello world")
    assert etag and b.get("a/k") == b"hello world"
    assert b.get_tagged("a/k") == (b"hello world", etag)
    assert b.head("a/k") == 11 and b.head("a/none") is None and b.stat("a/k") == (11, etag)
    assert b.get_range("a/k", 6, 5) == b"world"
    assert b.get_range_sized("a/k", 6, 50) == (b"world", 11)  # the answer states the size
    views = [memoryview(bytearray(3)), memoryview(bytearray(4))]
    assert b.read_into("a/k", 2, views) == (7, 11)  # bytes filled, the object's size
    assert [bytes(v) for v in views] == [b"llo", b" wor"]
    b.put("a/b/c", b"1")
    b.put("x", b"22")
    assert b.list() == [("a/b/c", 1), ("a/k", 11), ("x", 2)]
    assert b.list("a") == [("a/b/c", 1), ("a/k", 11)]
    assert b.list_dirs() == ["a"] and b.list_dirs("a") == ["b"]
    child = b.child("a")
    assert child.get("k") == b"hello world" and child.requests is b.requests
    assert b.download("a/k", tmp_path / "k") == crc32c.crc32c(b"hello world")
    assert (tmp_path / "k").read_bytes() == b"hello world"
    assert os.listdir(tmp_path) == ["k"]
    b.delete(["a/k", "a/none"])
    assert s3.keys() == ["run/ckpt/a/b/c", "run/ckpt/x"]
    assert set(b.requests) == {"PUT", "GET", "HEAD", "LIST", "DELETE"}


def test_failures_name_the_key(s3: S3, tmp_path: Path) -> None:
    b = Bucket.at(f"{s3.url}/p")
    with pytest.raises(MissingFileError) as missing:
        b.get("none")
    assert missing.value.path == f"{s3.url}/p/none"
    with pytest.raises(MissingFileError):
        b.download("none", tmp_path / "x")
    assert not list(tmp_path.iterdir())
    etag = b.put("k", b"1", create_only=True)
    with pytest.raises(DestinationExistsError, match=f"{s3.url}/p/k"):
        b.put("k", b"2", create_only=True)
    with pytest.raises(ObjectStoreError) as stale:
        b.put("k", b"2", if_match='"0123"')
    assert (stale.value.status, stale.value.op, stale.value.path) == (412, "PUT", f"{s3.url}/p/k")
    assert isinstance(stale.value, StorageError)
    assert b.put("k", b"3", if_match=etag) != etag and b.get("k") == b"3"
    nobucket = Bucket.at("s3://ckptfmt-no-such-bucket/p")
    with pytest.raises(ObjectStoreError, match="no such bucket") as gone:
        nobucket.list()
    assert gone.value.status == 404 and gone.value.path == "s3://ckptfmt-no-such-bucket/p"


def test_a_40_mib_file_goes_in_parts_with_its_crc(s3: S3, tmp_path: Path) -> None:
    data = os.urandom(40 << 20)
    path = tmp_path / "shard"
    path.write_bytes(data)
    b = Bucket.at(f"{s3.url}/ckpt")
    assert b.upload("shard", path) == crc32c.crc32c(data)
    head = s3.server.client().head_object(Bucket=s3.bucket, Key="ckpt/shard", PartNumber=1)
    assert head["PartsCount"] == 5  # 8 MiB parts
    assert b.requests["PUT"] == 5 + 2
    small = tmp_path / "small"
    small.write_bytes(data[: 16 << 20])
    b.upload("small", small)  # at the threshold: one PUT
    assert "PartsCount" not in s3.server.client().head_object(
        Bucket=s3.bucket, Key="ckpt/small", PartNumber=1
    )
    assert b.get("shard") == data and b.get("small") == data[: 16 << 20]


def test_a_slowdown_burst_is_retried(s3: S3, s3_proxy: S3Proxy, tmp_path: Path) -> None:
    data = os.urandom(24 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    b = Bucket.at(f"{s3.url}/ckpt")
    s3_proxy.slowdown(4, method="PUT")  # parts of the multipart upload
    s3_proxy.slowdown(2, method="POST")  # its start and completion
    s3_proxy.slowdown(3, method="GET")
    b.upload("f", path)
    assert b.get("f") == data
    assert s3_proxy.faults["slowdown"] == 9


def test_resets_in_the_middle_of_parts_are_retried(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    data = os.urandom(40 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    s3_proxy.reset_mid_body(3, min_body=1 << 20)
    b = Bucket.at(f"{s3.url}/ckpt")
    assert b.upload("f", path) == crc32c.crc32c(data)
    assert s3_proxy.faults["reset"] == 3
    assert b.get("f") == data
    s3_proxy.reset_mid_body(1, min_body=10)
    b.put("small", b"0123456789abcdef")  # a single PUT is retried too
    assert b.get("small") == b"0123456789abcdef"


def _fails_in_time_naming(
    b: Bucket, call: Callable[[], object], key: str, op: str, after: Callable[[], None]
) -> ObjectStoreError:
    """``call`` raises ObjectStoreError within FAST's deadline, naming ``key``'s URL and ``op``
    with no HTTP status; ``after`` runs once it has (the fault lifted)."""
    start = time.monotonic()
    with pytest.raises(ObjectStoreError) as info:
        call()
    took = time.monotonic() - start
    after()
    assert took < FAST["retry_timeout"] + FAST["timeout"] + 2, (op, took)
    assert info.value.path == b.key_url(key) and info.value.op == op, info.value
    assert info.value.status is None and b.key_url(key) in str(info.value)
    return info.value


def test_a_server_that_never_answers_fails_within_the_deadline_naming_the_key(
    s3: S3, s3_proxy: S3Proxy
) -> None:
    """A request taken and never answered (a hung server, a silent network) is given up after
    the request timeout, retried within the deadline, then named: never a hang."""
    b = Bucket.at(f"{s3.url}/ckpt", FAST)
    b.put("k", b"x")
    for call, op in (
        (lambda: b.get("k"), "GET"),
        (lambda: b.put("k", b"y"), "PUT"),
        (lambda: b.head("k"), "HEAD"),
    ):
        s3_proxy.stall(None, method=op)
        _fails_in_time_naming(b, call, "k", op, after=s3_proxy.clear)
    patient = Bucket.at(f"{s3.url}/ckpt", {**FAST, "timeout": 1, "retry_timeout": 10})
    s3_proxy.stall(1, method="GET")  # one stalled answer: timed out, retried, answered
    assert patient.get("k") == b"x"  # the stalled PUT never reached the server
    assert s3_proxy.faults["stall"] >= 4


def test_server_gone_fails_within_the_deadline_naming_the_key(
    s3: S3, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    b = Bucket.at(f"{s3.url}/ckpt", FAST)
    b.put("k", b"x")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(20 << 20))
    for call, key, op in (
        (lambda: b.put("k", b"y"), "k", "PUT"),
        (lambda: b.get("k"), "k", "GET"),
        (lambda: b.head("k"), "k", "HEAD"),
        (lambda: b.upload("big", path), "big", "PUT"),
        (lambda: b.list(), "", "LIST"),
    ):
        s3_proxy.down()
        err = _fails_in_time_naming(b, call, key, op, after=s3_proxy.up)
        assert "no answer" in str(err)
    assert b.get("k") == b"x"  # back: the same bucket works again


def test_a_persistent_5xx_names_its_status(s3: S3, s3_proxy: S3Proxy) -> None:
    b = Bucket.at(f"{s3.url}/ckpt", {**FAST, "max_retries": 2})
    s3_proxy.slowdown(100, method="PUT")
    with pytest.raises(ObjectStoreError, match="HTTP 503") as info:
        b.put("k", b"x")
    assert info.value.status == 503 and s3_proxy.faults["slowdown"] == 3  # 1 + 2 retries


def test_storage_options_override_the_environment(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    b = Bucket.at(
        s3.url,
        {
            "endpoint_url": endpoint,
            "aws_access_key_id": s3.env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": s3.env["AWS_SECRET_ACCESS_KEY"],
            "region": "us-east-1",
            "allow_http": "true",
        },
    )
    b.put("k", b"x")
    assert s3.keys() == ["k"]
    with pytest.raises(ObjectStoreError):
        Bucket.at(s3.url, FAST).put("k", b"y")
    with pytest.raises(UsageError, match="storage option"):
        Bucket.at(s3.url, {"retry_timeout": "soon"})


def test_s3fs_spellings_are_s3s(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """``key``, ``secret``, ``token`` and ``region_name`` (s3fs's) reach the S3 store."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    b = Bucket.at(
        s3.url,
        {
            "key": s3.env["AWS_ACCESS_KEY_ID"],
            "secret": s3.env["AWS_SECRET_ACCESS_KEY"],
            "token": "session",
            "region_name": "us-east-1",
        },
    )
    assert {k: b.options[k] for k in ("aws_session_token", "aws_region")} == {
        "aws_session_token": "session",
        "aws_region": "us-east-1",
    }
    b.put("k", b"x")
    assert s3.keys() == ["k"]


@pytest.mark.parametrize(
    ("url", "option", "says"),
    [
        ("gs://b/run", "token", "bearer_token"),
        ("gs://b/run", "key", "service_account"),
        ("gs://b/run", "secret", "service_account_key"),
        ("gs://b/run", "region_name", "no region setting"),
        ("az://c/run", "key", "account_key"),
        ("abfs://c/run", "secret", "client_secret"),
        ("az://c/run", "region_name", "no region setting"),
    ],
)
def test_s3fs_spellings_on_another_store_name_its_own_keys(
    url: str, option: str, says: str
) -> None:
    """No request: the option is refused when the bucket is made, naming the URL, the option
    and the store's own key, never as the AWS key the store cannot take."""
    options = {"account_name": "acct", option: "x"} if "://c/" in url else {option: "x"}
    with pytest.raises(UsageError) as caught:
        Bucket.at(url, options)
    text = str(caught.value)
    assert url in text and repr(option) in text and says in text, text
    assert "not valid for store" not in text, text


def test_azures_token_is_its_own_bearer_token() -> None:
    b = Bucket.at("az://c/run", {"account_name": "acct", "token": "bearer"})
    assert b.options == {"account_name": "acct", "token": "bearer"}


def test_without_obstore_a_url_user_is_told_what_to_install() -> None:
    code = (
        "import sys; sys.modules['obstore'] = None\n"
        "from ckptfmt.storage.objects import Bucket\n"
        "from ckptfmt.errors import CloudNotInstalledError\n"
        "try:\n    Bucket.at('s3://b/x')\n"
        "except CloudNotInstalledError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'ckptfmt[cloud]'" in out.stdout and "s3://b/x" in out.stdout
    assert issubclass(CloudNotInstalledError, UsageError)
