"""First contact with a bucket, against real S3 servers: a bucket that does not exist, a plain
``http://`` endpoint without the allow-http setting, no credentials, and credentials the store
refuses each give a :class:`~ckptfmt.errors.CkptError` that names the bucket or the endpoint and
what to set, in every path a user meets first: ``ckptfmt.save``, ``ckptfmt.load``,
``ckptfmt.latest``, a ``CheckpointManager`` with the bucket as level 3, and ``ckptfmt list`` /
``ckptfmt verify`` / ``ckptfmt inspect`` / ``ckptfmt gc`` (one line, a non-zero status, no
traceback).

No test reaches beyond 127.0.0.1: where credentials are missing the environment has none and
names a loopback store, which ckptfmt refuses before any request; where the client would ask an
instance-metadata service for a role, that service is a loopback server answering 403 (as the one
the issue met). Refused credentials come from a second moto server that checks them as S3 does
(IAM authentication on: ``kit.s3.start_checking_server``)."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kit.cli import run_cli
from kit.managers import NO_EXIT_HOOKS, NO_FSYNC
from kit.s3 import S3, S3Server, start_checking_server
from kit.s3_proxy import S3Proxy

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.errors import (
    BucketNotFoundError,
    CkptError,
    CredentialsError,
    HttpNotAllowedError,
    ObjectStoreSetupError,
    StorageError,
)

STATE = {"w": np.arange(6, dtype=np.float32)}


# --- the servers and the environments -----------------------------------------------------------


@pytest.fixture(scope="module")
def checking() -> Iterator[S3Server]:
    """A moto server that checks credentials (its own process), with one bucket, ``checked``."""
    for server in start_checking_server():
        server.make_bucket("checked")
        yield server


@pytest.fixture
def imds() -> Iterator[str]:
    """A loopback stand-in for the instance-metadata service of a machine with no role: it
    answers every request 403, as the one the issue met did."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = _refuse

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _only(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process's AWS environment is ``env`` and nothing else (no key, role or profile
    left over from the machine or another test)."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


class Case:
    """One first-contact failure: the URL to use, the error class, and what its message must
    name (the bucket or endpoint, and the setting to fix)."""

    def __init__(self, url: str, cls: type[ObjectStoreSetupError], *names: str) -> None:
        self.url, self.cls, self.names = url, cls, names


def _missing_bucket(s3: S3, monkeypatch: pytest.MonkeyPatch, **_: Any) -> Case:
    name = f"ckptfmt-no-such-bucket-{os.getpid()}"
    return Case(
        f"s3://{name}/run",
        BucketNotFoundError,
        f"no such bucket '{name}'",
        s3.server.endpoint,
        f"create the bucket {name}",
        "AWS_ENDPOINT_URL",
    )


def _http_not_allowed(s3: S3, monkeypatch: pytest.MonkeyPatch, **_: Any) -> Case:
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    return Case(
        f"{s3.url}/run",
        HttpNotAllowedError,
        s3.server.endpoint,
        "AWS_ALLOW_HTTP=true",
        'storage_options={"allow_http": True}',
    )


def _no_credentials(s3: S3, monkeypatch: pytest.MonkeyPatch, **_: Any) -> Case:
    _only(monkeypatch, {k: v for k, v in s3.env.items() if "KEY" not in k})
    return Case(
        f"{s3.url}/run",
        CredentialsError,
        s3.url,
        "no credentials",
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        '"aws_access_key_id"',
    )


def _no_role(s3: S3, monkeypatch: pytest.MonkeyPatch, imds: str, **_: Any) -> Case:
    """No keys, and the client told to ask the metadata service (AWS_METADATA_ENDPOINT), which
    knows no role: what a machine outside AWS with no credentials meets on AWS's endpoint."""
    env = {k: v for k, v in s3.env.items() if "KEY" not in k}
    _only(monkeypatch, {**env, "AWS_METADATA_ENDPOINT": imds})
    return Case(
        f"{s3.url}/run",
        CredentialsError,
        s3.url,
        "no instance role answered",
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    )


def _unknown_key(monkeypatch: pytest.MonkeyPatch, checking: S3Server, **_: Any) -> Case:
    _only(monkeypatch, {**checking.env, "AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"})
    return Case(
        "s3://checked/run",
        CredentialsError,
        "s3://checked",
        "AKIANOSUCHKEY0000000",
        "check AWS_ACCESS_KEY_ID",
    )


def _wrong_secret(monkeypatch: pytest.MonkeyPatch, checking: S3Server, **_: Any) -> Case:
    _only(monkeypatch, {**checking.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    return Case(
        "s3://checked/run",
        CredentialsError,
        "s3://checked",
        checking.env["AWS_ACCESS_KEY_ID"],
        "check AWS_SECRET_ACCESS_KEY",
    )


def _denied(monkeypatch: pytest.MonkeyPatch, checking: S3Server, **_: Any) -> Case:
    """A key the store knows whose user may do nothing (no policy)."""
    key = _powerless_key(checking)
    _only(monkeypatch, {**checking.env, **key})
    return Case(
        "s3://checked/run",
        CredentialsError,
        "s3://checked",
        key["AWS_ACCESS_KEY_ID"],
        "may not make this request",
        "s3:GetObject",
    )


_POWERLESS: dict[str, str] = {}


def _powerless_key(checking: S3Server) -> dict[str, str]:
    """The access key of an IAM user without any policy on the checking server (made once)."""
    if not _POWERLESS:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=checking.endpoint,
            region_name="us-east-1",
            aws_access_key_id=checking.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=checking.env["AWS_SECRET_ACCESS_KEY"],
        )
        iam.create_user(UserName="powerless")
        made = iam.create_access_key(UserName="powerless")["AccessKey"]
        _POWERLESS.update(
            AWS_ACCESS_KEY_ID=made["AccessKeyId"], AWS_SECRET_ACCESS_KEY=made["SecretAccessKey"]
        )
    return dict(_POWERLESS)


CASES: dict[str, Callable[..., Case]] = {
    "denied": _denied,
    "missing-bucket": _missing_bucket,
    "http-not-allowed": _http_not_allowed,
    "no-credentials": _no_credentials,
    "no-role": _no_role,
    "unknown-key": _unknown_key,
    "wrong-secret": _wrong_secret,
}


@pytest.fixture(params=sorted(CASES))
def case(
    request: pytest.FixtureRequest,
    s3: S3,
    monkeypatch: pytest.MonkeyPatch,
    imds: str,
    checking: S3Server,
) -> Case:
    return CASES[request.param](s3=s3, monkeypatch=monkeypatch, imds=imds, checking=checking)


def _says(case: Case, exc: BaseException) -> None:
    text = str(exc)
    assert isinstance(exc, case.cls), (type(exc), text)
    assert isinstance(exc, StorageError | CkptError)
    for name in case.names:
        assert name in text, (name, text)
    assert "Debug source" not in text and "\n" not in text


# --- every path a user meets first ---------------------------------------------------------------


def test_save_names_what_to_set(case: Case) -> None:
    with pytest.raises(CkptError) as got:
        ckptfmt.save(STATE, f"{case.url}/step-1")
    _says(case, got.value)


def test_load_names_what_to_set(case: Case) -> None:
    with pytest.raises(CkptError) as got:
        ckptfmt.load(f"{case.url}/step-1")
    _says(case, got.value)


def test_latest_names_what_to_set(case: Case) -> None:
    with pytest.raises(CkptError) as got:
        ckptfmt.latest(case.url)
    _says(case, got.value)


def test_a_manager_names_what_to_set_at_its_start(case: Case, tmp_path: Path) -> None:
    with pytest.raises(CkptError) as got:
        CheckpointManager(
            tmp_path / "l1",
            case.url,
            node="n0",
            write=NO_FSYNC,
            at_exit=NO_EXIT_HOOKS,
        )
    assert isinstance(got.value, StorageError), got.value
    text = str(got.value)
    assert "level 3" in text, text
    for name in case.names:
        assert name in text, (name, text)


@pytest.mark.parametrize("command", ["list", "verify", "inspect", "gc"])
def test_the_cli_names_what_to_set_in_one_line(case: Case, command: str) -> None:
    url = case.url if command in ("list", "gc") else f"{case.url}/step-1"
    result = run_cli(command, url)
    assert result.exit_code != 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    for name in case.names:
        if '"' not in name:  # a storage_options key: Python's, the command line has none
            assert name in lines[0], (name, lines[0])
    assert "storage_options" not in lines[0]


# --- what the settings named do ------------------------------------------------------------------


def test_the_settings_named_make_it_work(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hint, followed as it is written, makes the same call succeed."""
    url = f"{s3.url}/fixed/step-1"
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    with pytest.raises(HttpNotAllowedError):
        ckptfmt.save(STATE, url)
    ckptfmt.save(STATE, url, storage_options={"allow_http": True})
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert ckptfmt.load(url)["w"].tolist() == STATE["w"].tolist()

    key, secret = s3.env["AWS_ACCESS_KEY_ID"], s3.env["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(CredentialsError):
        ckptfmt.load(url)
    keys = {"aws_access_key_id": key, "aws_secret_access_key": secret}
    assert ckptfmt.load(url, storage_options=keys)["w"].tolist() == STATE["w"].tolist()

    with pytest.raises(BucketNotFoundError, match="create the bucket ckptfmt-made-later"):
        ckptfmt.save(STATE, "s3://ckptfmt-made-later/x", storage_options=keys)
    s3.server.make_bucket("ckptfmt-made-later")
    ckptfmt.save(STATE, "s3://ckptfmt-made-later/x", storage_options=keys)


def test_the_checking_server_takes_its_key(
    checking: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusals above are the key's, not the server's: with the right key the same calls
    work."""
    _only(monkeypatch, checking.env)
    url = "s3://checked/ok/step-1"
    ckptfmt.save(STATE, url)
    assert ckptfmt.load(url)["w"].tolist() == STATE["w"].tolist()
    assert ckptfmt.latest("s3://checked/ok") is not None


def test_no_request_is_made_before_the_settings_are_told(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain HTTP not allowed, and no credentials for a store that is not AWS's, are told from
    the settings alone: the client is never made to send anything (an endpoint nothing listens
    on shows it: a request would fail otherwise)."""
    dead = "http://127.0.0.1:9"
    _only(monkeypatch, {"AWS_ENDPOINT_URL": dead, "AWS_REGION": "us-east-1"})
    with pytest.raises(CredentialsError, match=re.escape(f"(endpoint {dead})")) as got:
        ckptfmt.latest("s3://any-bucket/run", storage_options={"allow_http": True})
    assert got.value.status is None and got.value.code == "missing"
    with pytest.raises(HttpNotAllowedError, match=re.escape(f"(endpoint {dead})")) as refused:
        ckptfmt.latest("s3://any-bucket/run")
    assert refused.value.status is None and refused.value.op == "SETUP"


def test_a_bucket_in_another_region_names_it(s3: S3, s3_proxy: S3Proxy) -> None:
    """S3's answer to a request signed for another region than the bucket's (400
    ``AuthorizationHeaderMalformed`` naming the right one), given by the proxy: the error says
    which ``AWS_REGION`` to set, and with it set the call goes through."""
    s3_proxy.answer_error(
        1,
        "400 Bad Request",
        "AuthorizationHeaderMalformed",
        "The authorization header is malformed; the region 'us-east-1' is wrong; "
        "expecting 'eu-west-1'",
        {"Region": "eu-west-1"},
    )
    with pytest.raises(ObjectStoreSetupError) as got:
        ckptfmt.latest(f"{s3.url}/run")
    assert got.value.status == 400 and s3.url in got.value.bucket
    assert 'AWS_REGION=eu-west-1 (in Python also storage_options={"region": "eu-west-1"})' in str(
        got.value
    )
    assert ckptfmt.latest(f"{s3.url}/run", storage_options={"region": "eu-west-1"}) is None


def test_a_public_bucket_needs_no_credentials_when_told(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_SKIP_SIGNATURE=true``, which the no-credentials error names for a public bucket,
    is taken as a setting of credentials: requests go out unsigned, which a public bucket
    answers, and a private one refuses with an error that asks for keys."""
    ckptfmt.save(STATE, f"{s3.url}/public/step-1")
    _only(monkeypatch, {k: v for k, v in s3.env.items() if "KEY" not in k})
    with pytest.raises(CredentialsError, match="AWS_SKIP_SIGNATURE=true for a public bucket"):
        ckptfmt.latest(f"{s3.url}/public")
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")
    with pytest.raises(CredentialsError, match="not a public bucket") as private:
        ckptfmt.latest(f"{s3.url}/public")
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(private.value)
    anyone = {"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:ListBucket"]}
    anyone["Resource"] = [f"arn:aws:s3:::{s3.bucket}", f"arn:aws:s3:::{s3.bucket}/*"]
    policy = json.dumps({"Version": "2012-10-17", "Statement": [anyone]})
    client = s3.server.client()
    client.put_bucket_policy(Bucket=s3.bucket, Policy=policy)
    for key in s3.keys("public/"):  # moto answers an unsigned HEAD by the object's ACL alone
        client.put_object_acl(Bucket=s3.bucket, Key=key, ACL="public-read")
    ref = ckptfmt.latest(f"{s3.url}/public")
    assert ref is not None and ref.step == 1
    assert ckptfmt.load(str(ref.path))["w"].tolist() == STATE["w"].tolist()


# --- Google Cloud Storage and Azure: each names its own settings ---------------------------------

QUICK = {"connect_timeout": "2", "timeout": "5", "max_retries": "0", "retry_timeout": "5"}
"""Timeouts that bound every request of these tests (the token request to a metadata service
included), so that none waits on a network this machine does not have."""


def _no_cloud_env(monkeypatch: pytest.MonkeyPatch, imds: str) -> None:
    """No AWS, Google or Azure settings, and each store's metadata service (where a machine of
    that cloud gets its identity) the loopback one that answers 403: a machine with no identity.
    (Google's client, told nothing, asks 169.254.169.254 after the host given: refused or
    unreachable here, bounded by ``QUICK``.)"""
    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "AZURE_", "GCE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GCE_METADATA_HOST", imds.removeprefix("http://"))
    monkeypatch.setenv("AZURE_MSI_ENDPOINT", f"{imds}/msi")


GS_AZ = {
    "gs": ("gs://ckptfmt-bucket/run", {}, ["GOOGLE_SERVICE_ACCOUNT", '"service_account"']),
    "az-no-account": (
        "az://ckptfmt-container/run",
        {},
        ["AZURE_STORAGE_ACCOUNT_NAME", '"account_name"', "AZURE_STORAGE_ACCOUNT_KEY"],
    ),
    "az": (
        "az://ckptfmt-container/run",
        {"account_name": "ckptfmtacct"},
        ["AZURE_STORAGE_ACCOUNT_KEY", '"account_key"', "AZURE_STORAGE_SAS_TOKEN"],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", sorted(GS_AZ))
def test_gs_and_az_without_credentials_name_their_own_settings(
    store: str, monkeypatch: pytest.MonkeyPatch, imds: str, tmp_path: Path
) -> None:
    """A ``gs://`` or ``az://`` URL on a machine with no credentials for it: ``ckptfmt.save``,
    ``load`` and ``latest`` raise :class:`CredentialsError` (a manager with it as level 3, a
    ``StorageError`` saying it of level 3) naming the bucket and that store's settings (Google's
    service account; Azure's account and key), never AWS's, at the first request or (no Azure
    account) before any; the CLI says it in one line. No request leaves this machine unbounded
    (``QUICK``)."""
    url, options, names = GS_AZ[store]
    _no_cloud_env(monkeypatch, imds)
    given = {**QUICK, **options}
    calls: list[Callable[[], Any]] = [
        lambda: ckptfmt.save(STATE, f"{url}/step-1", storage_options=given),
        lambda: ckptfmt.load(f"{url}/step-1", storage_options=given),
        lambda: ckptfmt.latest(url, storage_options=given),
        lambda: CheckpointManager(
            tmp_path / "l1",
            url,
            storage_options=given,
            node="n0",
            write=NO_FSYNC,
            at_exit=NO_EXIT_HOOKS,
        ),
    ]
    for call in calls:  # the manager's start says it of its level 3, as a StorageError
        with pytest.raises(StorageError) as got:
            call()
        text = str(got.value)
        assert isinstance(got.value, CredentialsError) or "level 3" in text, text
        assert url.split("/run")[0] in text and "no credentials" in text, text
        for name in names:
            assert name in text, (name, text)
        assert "AWS_" not in text and "aws_" not in text and "s3:" not in text, text
        assert "Debug source" not in text and "\n" not in text
    if not options:  # the CLI takes the environment only
        result = run_cli("list", url)
        assert result.exit_code != 0
        (line,) = result.output.strip().splitlines()
        assert names[0] in line and "AWS_" not in line, line
