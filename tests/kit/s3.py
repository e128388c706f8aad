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
import json
import os
import subprocess
import sys
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

    def put(self, key: str, data: bytes) -> None:
        """Write the object ``key`` (the test's own PUT, through boto3)."""
        self.server.client().put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        """The bytes of the object ``key`` (the test's own GET, through boto3)."""
        body = self.server.client().get_object(Bucket=self.bucket, Key=key)["Body"]
        return bytes(body.read())


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


# moto's server in a process of its own: IAM authentication is a process-wide setting of moto's
_CHECKING_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()  # until the test session closes it
server.stop()
"""
_SETUP_ACTIONS = 3  # unauthenticated: create the user, give it a policy, make its key


def start_checking_server() -> Iterator[S3Server]:
    """Start a moto server that checks credentials as S3 does, on a free port of 127.0.0.1, in a
    process of its own; yield it; stop it.

    moto accepts any key unless its IAM authentication is on (``INITIAL_NO_AUTH_ACTION_COUNT``:
    the requests answered before it checks). The first three requests make an IAM user allowed
    everything and its access key; from then on every request must be signed with that key:
    an unknown key id is answered ``403 InvalidAccessKeyId``, a wrong secret ``403
    SignatureDoesNotMatch``, as by S3. :attr:`S3Server.env` holds the valid key."""
    import boto3

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_ACTIONS)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHECKING_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:"), endpoint
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="ckptfmt")
        allow = {"Effect": "Allow", "Action": "*", "Resource": "*"}
        iam.put_user_policy(
            UserName="ckptfmt",
            PolicyName="everything",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [allow]}),
        )
        key = iam.create_access_key(UserName="ckptfmt")["AccessKey"]
        yield S3Server(
            endpoint,
            {
                "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ALLOW_HTTP": "true",
            },
        )
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
