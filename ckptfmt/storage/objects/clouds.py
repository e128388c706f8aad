"""The setup errors of Google Cloud Storage (``gs://``) and Azure Blob Storage (``az://``,
``abfs://``...): each names that store's own way to give credentials, never AWS's.

Both clients, given no credentials, ask the machine's metadata service for an identity (a
Google VM's service account, an Azure managed identity): on any other machine that token request
fails, and its failure is the first request's. Azure's client also needs the storage account's
name before it can make one. What S3 needs is in :mod:`.bucket` (``_setup_error``), which calls
:func:`setup_error` here for the other schemes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptfmt.errors import CredentialsError, ObjectStoreSetupError

GOOGLE = frozenset({"gs"})
AZURE = frozenset({"az", "abfs", "abfss", "azure"})

_GOOGLE_FIX = (
    "set GOOGLE_SERVICE_ACCOUNT (or GOOGLE_APPLICATION_CREDENTIALS) to a service account's JSON "
    "key file, or GOOGLE_SERVICE_ACCOUNT_KEY to the key itself (in Python also storage_options="
    '{"service_account": "<key file>"}), or GOOGLE_SKIP_SIGNATURE=true for a public bucket; on '
    "a Google Cloud VM, attach a service account to it"
)
_GOOGLE_DENIED = (
    "grant the service account roles/storage.objectAdmin on the bucket, or set other "
    "credentials (GOOGLE_SERVICE_ACCOUNT, GOOGLE_APPLICATION_CREDENTIALS)"
)
_AZURE_KEYS = (
    "AZURE_STORAGE_ACCOUNT_KEY, or AZURE_STORAGE_SAS_TOKEN, or a service principal's "
    "AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID, or AZURE_USE_AZURE_CLI=true"
)
_AZURE_FIX = (
    f"set {_AZURE_KEYS} (in Python also storage_options="
    '{"account_name": "<account>", "account_key": "<key>"}); on an Azure VM, give it a '
    "managed identity"
)
_AZURE_ACCOUNT_FIX = (
    "set AZURE_STORAGE_ACCOUNT_NAME to the storage account and its credentials: "
    f"{_AZURE_KEYS} (in Python also storage_options="
    '{"account_name": "<account>", "account_key": "<key>"})'
)
_AZURE_DENIED = (
    "grant the identity the Storage Blob Data Contributor role on the container, or set other "
    f"credentials: {_AZURE_KEYS}"
)

# what says where the credentials are, as each client takes it (a config key without its
# ``google_``/``azure_storage_``/``azure_`` prefix, or the environment variable)
_GOOGLE_GIVEN = frozenset(
    {
        "service_account",
        "service_account_path",
        "service_account_key",
        "application_credentials",
        "bearer_token",
        "skip_signature",
    }
)
_AZURE_GIVEN = frozenset(
    {
        "account_key",
        "access_key",
        "sas_key",
        "sas_token",
        "token",
        "bearer_token",
        "client_secret",
        "federated_token_file",
        "use_azure_cli",
        "skip_signature",
        "use_emulator",
    }
)


def setup_error(
    scheme: str,
    text: str,
    status: int | None,
    url: str,
    op: str,
    where: str,
    endpoint: str | None,
    options: Mapping[str, Any],
) -> ObjectStoreSetupError | None:
    """The setup error the library's error ``text`` (with HTTP ``status``, met on ``url``
    during ``op``; ``where``: the bucket's URL; ``options``: the config given) shows for a
    Google or Azure store, or None: credentials missing (the token request failed and nothing
    names any), refused (the token request failed for those given, or 401/403), or Azure's
    account not named."""
    google = scheme in GOOGLE
    if not google and "Account must be specified" in text:
        return no_account(url, where)
    fix = _GOOGLE_FIX if google else _AZURE_FIX
    if "token request" in text:  # the client's own search for credentials failed
        if not credentials_given(scheme, options):
            where_asked = "the metadata service" if google else "the managed-identity endpoint"
            why = f"none are set, and no identity answered at {where_asked}"
            return _credentials(url, op, status, f"no credentials: {why}", where, endpoint, fix)
        reason = "credentials refused: the token request with the credentials given failed"
        return _credentials(url, op, status, reason, where, endpoint, fix, "refused")
    if status in (401, 403):
        denied = _GOOGLE_DENIED if google else _AZURE_DENIED
        reason = "credentials refused: the credentials may not make this request"
        return _credentials(url, op, status, reason, where, endpoint, denied, str(status))
    return None


def no_account(url: str, where: str) -> CredentialsError:
    """An Azure URL with no storage account named: found before any request."""
    return CredentialsError(
        url,
        "SETUP",
        None,
        "no credentials: no storage account is named",
        bucket=where,
        endpoint=None,
        fix=_AZURE_ACCOUNT_FIX,
        code="missing",
    )


def credentials_given(scheme: str, options: Mapping[str, Any]) -> bool:
    """Whether ``options`` (the config given, keys lower-cased) or the environment say where a
    Google or Azure client's credentials are."""
    known = _GOOGLE_GIVEN if scheme in GOOGLE else _AZURE_GIVEN
    prefixes = ("google_",) if scheme in GOOGLE else ("azure_storage_", "azure_")
    env = ("GOOGLE_",) if scheme in GOOGLE else ("AZURE_STORAGE_", "AZURE_")
    for key, value in options.items():
        if _bare(key.lower(), prefixes) in known and _set(value):
            return True
    return any(
        _bare(key.lower(), tuple(e.lower() for e in env)) in known and _set(value)
        for key, value in os.environ.items()
        if key.startswith(env)
    )


def _bare(key: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _set(value: Any) -> bool:
    return value is not None and str(value).strip().lower() not in ("", "false", "0", "no", "off")


def _credentials(
    url: str,
    op: str,
    status: int | None,
    reason: str,
    where: str,
    endpoint: str | None,
    fix: str,
    code: str = "missing",
) -> CredentialsError:
    return CredentialsError(
        url, op, status, reason, bucket=where, endpoint=endpoint, fix=fix, code=code
    )
