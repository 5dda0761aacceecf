"""The Vast.ai API as this provider calls it: the SDK client, retries and rate limits.

Every call goes through :meth:`VastApi.call`: 5xx and transport errors are retried with
backoff (never for a create, whose 5xx may have rented), and a rate limit (HTTP 429) is a
wait, not a failure: the call waits its ``Retry-After`` (else the backoff) and asks again
within the budget of what it is part of, then fails with :class:`VastRateLimited`. The
instance list is read from the paged v1 endpoint, and a page without its ``instances``
key is an error, never an empty account. A destroy is repeated until the API no longer
shows the instance.
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import requests

from activities.heartbeat import activity_deadline
from activities.providers.base import ProviderUnavailable
from activities.providers.vastai.worker_env import settings
from mvp_core.vastai_env import API_KEY_ENV

log = logging.getLogger("mvp.provider.vastai")

# The statuses of an instance that is not (and will not come) up.
NOT_RUNNING = ("exited", "unknown", "offline", "stopped", "frozen")
_API_ATTEMPTS = 8
_API_BACKOFF_S = (0.25, 8.0)
# Rate limits (HTTP 429): one call waits them out for at most this long, and never past
# the end of the activity it runs in less _BUDGET_MARGIN_S (time to report the failure).
_RATE_LIMIT_CALL_S = 300.0
_BUDGET_MARGIN_S = 10.0
_RETRY_AFTER_MAX_S = 120.0  # a longer Retry-After is waited this long, then asked again

T = TypeVar("T")


class VastApiError(RuntimeError):
    """An API call failed for good; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, what: str, status: int, body: dict[str, Any] | None) -> None:
        self.status = status
        self.body = body or {}
        why = self.body.get("msg") or self.body.get("error") or ""
        super().__init__(f"{what}: HTTP {status}{f' ({why})' if why else ''}"[:400])


class VastRateLimited(VastApiError):
    """The API kept answering HTTP 429 until the call's budget ran out."""

    def __init__(self, what: str, tries: int, waited_s: float, retry_after: str | None) -> None:
        self.tries, self.waited_s = tries, waited_s
        told = f"Retry-After {retry_after}" if retry_after is not None else "no Retry-After"
        super().__init__(what, 429, None)
        self.args = (
            f"{what}: Vast.ai rate limit: HTTP 429 to {tries} tries over {waited_s:.1f} s "
            f"({told}), and the budget of this step ends before the next; try again later "
            "or with fewer nodes starting at once",
        )


def backoff() -> Iterator[float]:
    """Waits that double from 0.25 s up to 8 s."""
    delay, cap = _API_BACKOFF_S
    while True:
        yield delay
        delay = min(delay * 2, cap)


def _body(err: requests.HTTPError) -> dict[str, Any]:
    try:
        found = err.response.json() if err.response is not None else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _status(err: requests.HTTPError) -> int:
    return err.response.status_code if err.response is not None else 0


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for: delay-seconds or an HTTP date (RFC 9110
    10.2.3); None when absent or unreadable. Never negative, at most _RETRY_AFTER_MAX_S."""
    if value is None or not value.strip():
        return None
    try:
        wait = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        wait = when.timestamp() - time.time()
    if wait != wait:  # NaN
        return None
    return min(max(wait, 0.0), _RETRY_AFTER_MAX_S)


def _budget_end(deadline: float | None) -> float:
    """Until when (``time.monotonic()``) one call may wait out rate limits."""
    end = time.monotonic() + _RATE_LIMIT_CALL_S
    activity_end = activity_deadline()
    if activity_end is not None:
        end = min(end, activity_end - _BUDGET_MARGIN_S)
    return end if deadline is None else min(end, deadline)


class VastApi:
    """The account's API, through the ``vastai`` SDK, made on first use."""

    def __init__(self) -> None:
        self._sdk: Any = None

    def sdk(self) -> Any:
        """The ``vastai`` SDK client; ProviderUnavailable without an API key."""
        if self._sdk is None:
            env = settings()
            if env.api_key is None:
                raise ProviderUnavailable(
                    f"{API_KEY_ENV} is required when the provider is vastai (set it in the "
                    "orchestrator worker's environment)"
                )
            from vastai import VastAI  # the SDK only when a vastai run needs it

            # retry=1: this provider retries itself, with backoff and a deadline.
            self._sdk = VastAI(
                api_key=env.api_key.get_secret_value(),
                server_url=env.server_url,
                retry=1,
                raw=True,
            )
        return self._sdk

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        retry: bool = True,
        deadline: float | None = None,
    ) -> T:
        """``fn()`` with 5xx and transport errors retried with backoff (``retry``: a
        create's 5xx may have rented, so it is never repeated blindly). A 429 is always
        asked again, after its ``Retry-After`` (else the backoff), until the budget ends
        (:func:`_budget_end`; ``deadline``, a ``time.monotonic()``, may end it sooner):
        then VastRateLimited."""
        waits = backoff()
        failures = 0  # 5xx and transport errors; 429s do not count
        limited = 0
        first_limited = 0.0
        end: float | None = None
        while True:
            try:
                return fn()
            except requests.HTTPError as err:
                status = _status(err)
                if status == 429:
                    body = _body(err)
                    if body.get("error") == "search_quota_exceeded":
                        raise VastApiError(
                            f"{what}: the account's daily search quota is spent (it resets "
                            "at 00:00 UTC)",
                            429,
                            body,
                        ) from None
                    header = (
                        err.response.headers.get("Retry-After")
                        if err.response is not None
                        else None
                    )
                    told = retry_after_s(header)
                    wait = told if told is not None else next(waits)
                    now = time.monotonic()
                    if not limited:
                        first_limited, end = now, _budget_end(deadline)
                    limited += 1
                    assert end is not None
                    if now + wait > end:
                        raise VastRateLimited(what, limited, now - first_limited, header) from None
                    log.info("%s: rate limited (HTTP 429); asking again in %.1f s", what, wait)
                    time.sleep(wait)
                    continue
                failures += 1
                if not retry or status < 500 or failures >= _API_ATTEMPTS:
                    raise VastApiError(what, status, _body(err)) from None
            except (requests.ConnectionError, requests.Timeout) as err:
                failures += 1
                if not retry or failures >= _API_ATTEMPTS:
                    raise VastApiError(f"{what}: {type(err).__name__}", 0, None) from None
            time.sleep(next(waits))

    def instances(self) -> list[dict[str, Any]]:
        """Every instance of the account, from the paged v1 list; a page without its
        ``instances`` key is an error (an API change must never look like "none")."""
        sdk = self.sdk()
        params: dict[str, Any] = {
            "select_filters": {},
            "order_by": [{"col": "id", "dir": "asc"}],
            "limit": 25,
        }
        rows: list[dict[str, Any]] = []
        for _ in range(10_000):
            page = self.call("list instances", lambda: sdk.show_instances_v1(dict(params)))
            if not isinstance(page, dict) or not isinstance(page.get("instances"), list):
                raise VastApiError("list instances: the answer has no 'instances' list", 200, None)
            rows.extend(r for r in page["instances"] if isinstance(r, dict))
            token = page.get("next_token")
            if not token:
                return rows
            params["after_token"] = token
        raise VastApiError("list instances: more than 10000 pages", 200, None)

    def show(self, instance_id: int, deadline: float | None = None) -> dict[str, Any] | None:
        row = self.call(
            f"show instance {instance_id}",
            lambda: self.sdk().show_instance(instance_id),
            deadline=deadline,
        )
        return row if isinstance(row, dict) else None

    def destroy(self, instance_id: int, deadline_s: float | None = None) -> None:
        """DELETE until the API confirms the instance gone; 404 is success. Raises
        VastApiError when it is still there at the deadline."""
        if deadline_s is None:
            deadline_s = settings().destroy_deadline_s
        sdk = self.sdk()
        deadline = time.monotonic() + deadline_s
        waits = backoff()
        last: VastApiError | None = None
        while True:
            try:
                # One try per round: this loop backs off itself, within the deadline.
                self.call(
                    f"destroy instance {instance_id}",
                    lambda: sdk.destroy_instance(instance_id),
                    retry=False,
                    deadline=deadline,
                )
            except VastApiError as err:
                if err.status != 404:
                    last = err
            try:
                if self.show(instance_id, deadline) is None:
                    log.info("instance %s destroyed", instance_id)
                    return
            except VastApiError as err:
                last = err
            if time.monotonic() > deadline:
                raise last or VastApiError(
                    f"destroy instance {instance_id}: still listed after {deadline_s:.0f} s",
                    0,
                    None,
                )
            time.sleep(next(waits))
