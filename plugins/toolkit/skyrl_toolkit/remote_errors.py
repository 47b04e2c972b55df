"""What an object store's client raises for a mistake the user can fix, as one line.

fsspec's filesystems for ``s3://`` (s3fs, botocore) raise, for a URL the job names:

- ``NoCredentialsError`` / ``PartialCredentialsError``: no credentials were found;
- ``EndpointConnectionError`` / ``ConnectTimeoutError``: the endpoint cannot be reached
  (a wrong ``endpoint_url``, a server that is down);
- ``PermissionError`` (from a ``ClientError`` 403: ``InvalidAccessKeyId``,
  ``SignatureDoesNotMatch``, ``AccessDenied``): wrong credentials, or no right to the bucket;
- ``FileNotFoundError`` from a ``ClientError`` ``NoSuchBucket``: the bucket does not exist.

:func:`remote_error` turns each into a :class:`~skyrl_host.errors.UserError` naming the URL
and the fix, and returns None for anything else (a missing object, a fault), which the
caller handles as before. Light: botocore is not imported (errors are told by class name).
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Iterator

from skyrl_host.errors import Problem, UserError

CREDENTIALS_ENV = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    error = response.get("Error", {}) if isinstance(response, dict) else {}
    return str(error.get("Code", "")) if isinstance(error, dict) else ""


def _endpoint(exc: BaseException, fallback: str | None) -> str | None:
    kwargs = getattr(exc, "kwargs", None)
    url = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
    if isinstance(url, str) and url:
        parts = urllib.parse.urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url
    return fallback


def endpoint_of(storage_options: Any) -> str | None:
    """``client_kwargs.endpoint_url`` (or ``endpoint_url``) of fsspec storage options."""
    if not isinstance(storage_options, dict):
        return None
    client = storage_options.get("client_kwargs")
    url = client.get("endpoint_url") if isinstance(client, dict) else None
    url = url or storage_options.get("endpoint_url")
    return url if isinstance(url, str) else None


def remote_message(url: str, exc: BaseException, *, options: str = "storage_options",
                   endpoint: str | None = None) -> str | None:
    """The sentence for ``exc``, raised reaching ``url``, or None if it is not a user's mistake
    this module knows. ``options``: how the job names its storage options (for the fix);
    ``endpoint``: the ``endpoint_url`` the options give, if any."""
    for e in _chain(exc):
        names, code = _names(e), _code(e)
        if names & {"NoCredentialsError", "PartialCredentialsError"}:
            return (f"no credentials to reach {url}: set {options} = {{key = \"...\", secret = \"...\"}}, "
                    f"or {CREDENTIALS_ENV} in the environment")
        if names & {"EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError"}:
            where = _endpoint(e, endpoint)
            target = f"the endpoint {where}" if where else "the storage endpoint"
            return (f"cannot reach {url}: {target} does not answer; check {options}'s "
                    f"client_kwargs = {{endpoint_url = \"...\"}} (is the server up?)")
        if code == "NoSuchBucket":
            bucket = urllib.parse.urlsplit(url).netloc or "?"
            return f"cannot reach {url}: the bucket {bucket!r} does not exist; create it, or fix the bucket in the URL"
        if code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
                    "InvalidToken", "ExpiredToken"}:
            return (f"access to {url} is denied ({code}): check the credentials ({options} key and secret, "
                    f"or {CREDENTIALS_ENV}) and that they may read and write this bucket")
    local = "://" not in url or url.startswith("file://")
    for e in _chain(exc):
        if isinstance(e, PermissionError) and not local:
            detail = " ".join(str(e).split()) or "permission denied"
            return (f"access to {url} is denied ({detail}): check the credentials ({options} key and secret, "
                    f"or {CREDENTIALS_ENV}) and that they may read and write this bucket")
    return None


def remote_error(url: str, exc: BaseException, *, key: str | None = None, options: str = "storage_options",
                 endpoint: str | None = None) -> UserError | None:
    """:func:`remote_message` as a :class:`UserError` at ``key`` (None if not a user's mistake)."""
    message = remote_message(url, exc, options=options, endpoint=endpoint)
    return None if message is None else UserError(Problem(message, key=key))
