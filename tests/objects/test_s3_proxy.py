"""The fault-injecting proxy does what each rule says, as seen by obstore (the client ckptfmt
uses), unretried: a 503 SlowDown, a connection reset in a PUT body, the server gone, a flipped
byte in a GET answer; requests are counted by method."""

from __future__ import annotations

from datetime import timedelta

import obstore
import pytest
from kit.s3 import S3
from kit.s3_proxy import S3Proxy
from obstore.store import from_url


def _store(s3: S3, retries: int = 0):  # type: ignore[no-untyped-def]
    return from_url(
        s3.url,
        retry_config={
            "max_retries": retries,
            "retry_timeout": timedelta(seconds=5),
            "backoff": {"init_backoff": timedelta(milliseconds=10)},
        },
    )


def test_requests_pass_through_and_are_counted(s3: S3, s3_proxy: S3Proxy) -> None:
    store = _store(s3)
    obstore.put(store, "a/k", b"hello")
    assert bytes(obstore.get(store, "a/k").bytes()) == b"hello"
    assert s3_proxy.requests["PUT"] == 1 and s3_proxy.requests["GET"] == 1
    assert s3.keys() == ["a/k"]


def test_slowdown_answers_503_and_a_retry_gets_through(s3: S3, s3_proxy: S3Proxy) -> None:
    s3_proxy.slowdown(1, method="PUT")
    with pytest.raises(Exception, match="503") as info:
        obstore.put(_store(s3), "k", b"x")
    assert "SlowDown" in str(info.value)
    assert s3.keys() == []
    s3_proxy.slowdown(2, method="PUT")
    obstore.put(_store(s3, retries=3), "k", b"x")
    assert s3_proxy.faults["slowdown"] == 3 and s3.keys() == ["k"]


def test_reset_mid_body_drops_the_connection(s3: S3, s3_proxy: S3Proxy) -> None:
    s3_proxy.reset_mid_body(1, min_body=1000)
    obstore.put(_store(s3), "small", b"x" * 10)  # below min_body: passes
    with pytest.raises(Exception, match=r"(?i)error sending request|connection|reset"):
        obstore.put(_store(s3), "big", b"y" * 100_000)
    assert s3_proxy.faults["reset"] == 1
    assert s3.keys() == ["small"]


def test_down_refuses_every_connection_until_up(s3: S3, s3_proxy: S3Proxy) -> None:
    store = _store(s3)
    obstore.put(store, "k", b"x")  # a connection is open and idle in the client's pool
    s3_proxy.down()
    with pytest.raises(Exception, match=r"(?i)error sending request|connection|reset"):
        obstore.get(store, "k")
    with pytest.raises(Exception, match=r"(?i)error sending request|connection|reset"):
        obstore.get(_store(s3), "k")
    s3_proxy.up()
    assert bytes(obstore.get(_store(s3), "k").bytes()) == b"x"


def test_flip_byte_changes_one_byte_of_matching_gets(s3: S3, s3_proxy: S3Proxy) -> None:
    store = _store(s3)
    data = bytes(range(256)) * 4
    obstore.put(store, "ckpt/shard", data)
    obstore.put(store, "ckpt/other", data)
    s3_proxy.flip_byte("shard", n=1)
    got = bytes(obstore.get(store, "ckpt/shard").bytes())
    diff = [i for i in range(len(data)) if got[i] != data[i]]
    assert diff == [len(data) // 2] and got[diff[0]] == data[diff[0]] ^ 0xFF
    assert bytes(obstore.get(store, "ckpt/other").bytes()) == data
    assert bytes(obstore.get(store, "ckpt/shard").bytes()) == data  # n=1: once
    s3_proxy.flip_byte("shard")
    ranged = bytes(obstore.get_range(store, "ckpt/shard", start=100, length=10))
    assert ranged != data[100:110] and sum(a != b for a, b in zip(ranged, data[100:110])) == 1


def test_drop_answer_lets_the_request_act_and_hides_the_answer(s3: S3, s3_proxy: S3Proxy) -> None:
    s3_proxy.drop_answer(1, method="PUT")
    with pytest.raises(Exception, match=r"(?i)error sending request|connection|reset"):
        obstore.put(_store(s3), "k", b"acted")
    assert s3_proxy.faults["drop"] == 1
    assert bytes(obstore.get(_store(s3), "k").bytes()) == b"acted"


def test_refuse_answers_the_status_and_passes_nothing_on(s3: S3, s3_proxy: S3Proxy) -> None:
    s3_proxy.refuse(1, 403, method="PUT", path_contains="commit")
    obstore.put(_store(s3), "other", b"x")  # not matching: passes
    with pytest.raises(Exception, match="403") as info:
        obstore.put(_store(s3, retries=3), "a/commit", b"x")  # a 4xx is not retried
    assert "AccessDenied" in str(info.value)
    assert s3_proxy.faults["refuse"] == 1 and s3.keys() == ["other"]
    obstore.put(_store(s3), "a/commit", b"y")  # the rule is spent
    assert s3.keys() == ["a/commit", "other"]
