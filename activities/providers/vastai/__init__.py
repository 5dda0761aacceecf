"""The Vast.ai provider: each node one rented instance, reached over SSH.

Paid instances are the one resource here that costs money while it leaks, so every step
is built around never losing one:

- **Idempotent by label.** Every instance carries the label ``mvp-<run>-<node>-<nonce8>``
  (the node's resource name). A start first adopts its own record, then an instance the
  API reports with its label, and only then rents; a worker killed between the create call
  and the record therefore never rents twice. The instance id is written to the node's
  state file (fsync, rename) before anything else happens to it.
- **Always destroy, never stop** (a stopped instance keeps billing its disk). "No such
  instance" and 404 are success; 5xx are retried with backoff; a destroy that keeps
  failing is returned as a stop error, and the reaper destroys the instance on its next
  sweep because the API still lists it.
- **A rate limit is a wait, not a failure.** Vast.ai answers a request over its rate
  limit with HTTP 429 and ``Retry-After`` (seconds until its token bucket refills). Every
  call waits that long (else backs off) and asks again, the same call on the same offer:
  a 429 says the request was not served, so even a create is safe to repeat. The waits
  stay within the budget of what the call is part of (the activity's start-to-close
  timeout, less a margin; a destroy's own deadline): past it, the call fails with
  :class:`VastRateLimited`, which names the rate limit. The daily search quota (a 429
  ``search_quota_exceeded``, reset at UTC midnight) is not waited out.
- **No silent "nothing there".** The instance list is read from the paged v1 endpoint
  and a page without its ``instances`` key is an error, never an empty account.
- **A create error that carries a contract id** destroys that instance.

Reaching things: the node's data plane listens on a container port that Vast.ai maps to
a public port; the node advertises the instance's public address and that mapped port. A
Temporal address that only this host can reach (loopback) is carried to the instance by
a reverse SSH tunnel that this provider keeps up for the node's life (``poll_exited``
restarts it). The API key and the SSH identity exist only in this worker's environment;
the node's own secrets (edge token, payload key) travel over SSH stdin into a 0600 file,
never on a command line.

The package, one job a module: ``worker_env`` (this worker's settings), ``api`` (the
SDK client, retries, rate limits, destroy), ``records`` (the node's state file),
``offers`` (search filters and order), ``rental`` (adopt or rent, wait until running),
``ssh`` (identity, endpoint, commands, uploads), ``tunnel`` (reaching Temporal),
``node_agent`` (the node's environment, launch and stop) and ``provider`` (the
:class:`VastAiProvider` that runs them in order).
"""

from activities.providers.vastai.api import VastApi, VastApiError, VastRateLimited, retry_after_s
from activities.providers.vastai.provider import VastAiProvider
from activities.providers.vastai.ssh import key_body, public_key_of
from activities.providers.vastai.tunnel import only_this_side
from activities.providers.vastai.worker_env import identity_path, server_url, settings

__all__ = [
    "VastAiProvider",
    "VastApi",
    "VastApiError",
    "VastRateLimited",
    "identity_path",
    "key_body",
    "only_this_side",
    "public_key_of",
    "retry_after_s",
    "server_url",
    "settings",
]
