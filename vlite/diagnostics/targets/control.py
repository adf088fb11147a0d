"""leak-check's control requests over ``--url`` (drain polling, idle-point scrapes, ``/debug``
endpoints, the final census): a 5xx answer or a dropped connection there is a finding about
the server (``checks/engine_errors.py``), named by its endpoint, never a crash of the tool.
The replay's own requests, which it aborts on purpose, are not control requests."""

from __future__ import annotations

import httpx

from vlite.diagnostics.checks.engine_errors import engine_error

# What a failed control request raises: the connection dropped or timed out, or a 5xx
# (``HTTPStatusError``), or a page that does not parse (``ValueError``, ``KeyError``).
CONTROL_FAILURES = (httpx.HTTPError, ValueError, KeyError)


def checked(response: httpx.Response) -> httpx.Response:
    """``response`` unless the server answered 5xx (a 4xx, e.g. ``/debug`` off, is an answer).

    Raises:
        httpx.HTTPStatusError: a 5xx status.
    """
    if response.is_server_error:
        response.raise_for_status()
    return response


def get(client: httpx.Client, url: str, **kwargs) -> httpx.Response:
    """``client.get(url)`` through ``checked``.

    Raises:
        httpx.HTTPError: the connection failed, or a 5xx status.
    """
    return checked(client.get(url, **kwargs))


# failures kept per endpoint: a poll that fails for a minute says so in a few, not hundreds
MAX_PER_ENDPOINT = 10


def failed(endpoint: str, exc: BaseException, errors: list[dict] | None) -> None:
    """Record a failed control request to ``endpoint`` ("GET /debug/blocks (final snapshot)"),
    up to ``MAX_PER_ENDPOINT`` per endpoint."""
    if errors is not None and sum(e["path"] == endpoint for e in errors) < MAX_PER_ENDPOINT:
        errors.append(engine_error(endpoint, None, exc))


def try_get(client: httpx.Client, url: str, endpoint: str, errors: list[dict], **kwargs) -> httpx.Response | None:
    """``get``, or None (recorded in ``errors``) when it failed."""
    try:
        return get(client, url, **kwargs)
    except CONTROL_FAILURES as exc:
        failed(endpoint, exc, errors)
        return None
