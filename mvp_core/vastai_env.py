"""The Vast.ai settings a process reads from its environment, as one typed model.

The run's own Vast.ai settings (image, offers, timeouts) travel in the run request
(:class:`mvp_core.models.VastAiSettings`); what stays in the environment of the process
that talks to Vast.ai is its secret and its operator's choices of where things are: the
API key, the API's address, the SSH identity, a Temporal address rented hosts reach as it
is, and how long one stop keeps destroying. The provider (``activities/providers/
vastai/``), the process host's configuration (``mvp_core/host_config.py``) and a rented
node's self-destroy (``workers/node/self_destroy.py``) all read them through
:meth:`VastAiEnvironment.from_env`, so every variable has one name, one default and one
error text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

API_KEY_ENV = "VASTAI_API_KEY"
SERVER_URL_ENV = "MVP_VASTAI_SERVER_URL"  # else the SDK's VAST_URL, else Vast.ai itself
SDK_SERVER_URL_ENV = "VAST_URL"
SSH_IDENTITY_ENV = "MVP_VASTAI_SSH_IDENTITY"
TEMPORAL_ADDRESS_ENV = "MVP_VASTAI_TEMPORAL_ADDRESS"  # an address instances reach as is
DESTROY_DEADLINE_ENV = "MVP_VASTAI_DESTROY_DEADLINE_S"  # how long one stop keeps destroying
INSTANCE_ID_ENV = "MVP_VASTAI_INSTANCE_ID"  # set on a rented node by the provider

DEFAULT_SERVER_URL = "https://console.vast.ai"
DEFAULT_SSH_IDENTITY = Path(".ssh") / "id_ed25519"  # under $HOME
DEFAULT_DESTROY_DEADLINE_S = 90.0

# The variables an operator may set for a process host (docs/host.md "Environment"); the
# API key and the identity reach the host through its configuration instead.
HOST_OPERATIONAL = (SERVER_URL_ENV, TEMPORAL_ADDRESS_ENV, DESTROY_DEADLINE_ENV)


class VastAiEnvError(ValueError):
    """A Vast.ai variable's value is unusable; the text names the variable, never a key."""


class VastAiEnvironment(BaseModel):
    """The Vast.ai settings of this process's environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: SecretStr | None = None
    server_url: str = DEFAULT_SERVER_URL
    ssh_identity: Path = Field(
        default=Path("~") / DEFAULT_SSH_IDENTITY,
        description="The SSH private key (a leading ~ when HOME was unset)",
    )
    temporal_address: str | None = None
    destroy_deadline_s: float = Field(default=DEFAULT_DESTROY_DEADLINE_S, gt=0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> VastAiEnvironment:
        """Read every variable; blank counts as unset. Raises VastAiEnvError."""

        def get(name: str) -> str | None:
            return (environ.get(name) or "").strip() or None

        key = get(API_KEY_ENV)
        if key is not None and any(c.isspace() or not c.isprintable() for c in key):
            raise VastAiEnvError(f"invalid {API_KEY_ENV}: must be one token without whitespace")
        url = get(SERVER_URL_ENV) or get(SDK_SERVER_URL_ENV) or DEFAULT_SERVER_URL
        identity_text = get(SSH_IDENTITY_ENV) or f"~/{DEFAULT_SSH_IDENTITY}"
        home = get("HOME")
        if identity_text.startswith("~/") and home:
            identity = Path(home) / identity_text[2:]
        else:
            identity = Path(identity_text)  # a leading ~ stays for expanduser
        deadline_text = get(DESTROY_DEADLINE_ENV)
        deadline = DEFAULT_DESTROY_DEADLINE_S
        if deadline_text is not None:
            try:
                deadline = float(deadline_text)
            except ValueError:
                deadline = math.nan
            if not math.isfinite(deadline) or deadline <= 0:
                raise VastAiEnvError(
                    f"invalid {DESTROY_DEADLINE_ENV}={deadline_text!r}: expected seconds, a "
                    "number greater than 0"
                )
        return cls(
            api_key=SecretStr(key) if key else None,
            server_url=url.rstrip("/"),
            ssh_identity=identity,
            temporal_address=get(TEMPORAL_ADDRESS_ENV),
            destroy_deadline_s=deadline,
        )


def credentials_env(api_key: SecretStr, ssh_identity: Path) -> dict[str, str]:
    """The variables a host hands the orchestrator worker it starts for a Vast.ai run
    (the worker's provider reads them back with :meth:`VastAiEnvironment.from_env`)."""
    return {API_KEY_ENV: api_key.get_secret_value(), SSH_IDENTITY_ENV: str(ssh_identity)}
