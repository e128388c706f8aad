"""A real S3 server for the object-store tests: moto's ``ThreadedMotoServer`` on 127.0.0.1.

It is a real HTTP server speaking the S3 protocol (signatures, multipart uploads, ``If-None-Match``
and ``If-Match`` conditional puts answered with ``412``), so the tests exercise ckptfmt's client
code end to end; nothing in the client is mocked. One server runs per test session (it starts in
well under a second); each test gets its own bucket.

Processes launched by a test (``mpiexec``, ``torchrun``) reach the server through the standard AWS
environment variables, which :attr:`S3.env` holds; in-process code gets them through
``monkeypatch`` (the :func:`s3` fixture sets them).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

_BUCKETS = itertools.count()


@dataclass
class S3Server:
    """The running server: its endpoint and the environment that points a client at it."""

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given) and return its name."""
        import boto3

        name = name or f"ckpt-{os.getpid()}-{next(_BUCKETS)}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_REGION"],
        )
        client.create_bucket(Bucket=name)
        return name

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 client for the tests' own look at the bucket (never used by ckptfmt)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_REGION"],
        )


@dataclass
class S3:
    """One test's bucket on the session's server: ``url`` is ``s3://<bucket>``, ``env`` the AWS
    variables a subprocess needs (with the kit's ``with_kit_path`` on top, for workers)."""

    server: S3Server
    bucket: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    @property
    def env(self) -> dict[str, str]:
        return dict(self.server.env)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under ``prefix`` (the test's own LIST, through boto3)."""
        client = self.server.client()
        out: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)


def start_server() -> Iterator[S3Server]:
    """Start moto's server on a free port of 127.0.0.1; yield it; stop it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "ckptfmt-test",
        "AWS_SECRET_ACCESS_KEY": "ckptfmt-test",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }
    try:
        yield S3Server(endpoint, env)
    finally:
        server.stop()
