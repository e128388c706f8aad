"""The tests' S3 server is real: it honours create-only and If-Match puts, which the commit
protocol on object storage relies on (a server that ignored them would make those tests lie)."""

from __future__ import annotations

import obstore
import pytest
from kit.s3 import S3
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import from_url


def test_create_only_and_if_match_puts_are_enforced(s3: S3) -> None:
    store = from_url(f"{s3.url}/x")
    first = obstore.put(store, "k", b"one", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "k", b"two", mode="create")
    second = obstore.put(store, "k", b"two", mode={"e_tag": first["e_tag"]})
    with pytest.raises(PreconditionError):
        obstore.put(store, "k", b"three", mode={"e_tag": first["e_tag"]})
    assert bytes(obstore.get(store, "k").bytes()) == b"two"
    assert second["e_tag"] != first["e_tag"]
    assert s3.keys() == ["x/k"]
