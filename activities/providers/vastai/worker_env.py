"""This worker's Vast.ai settings, read through the one model of mvp_core/vastai_env.py.

The API key, the SSH identity and the addresses exist only in the orchestrator worker's
environment; every module of the provider reads them here, so an unusable setting is
reported the same way (ProviderUnavailable) wherever it is first needed.
"""

from __future__ import annotations

import os
from pathlib import Path

from activities.providers.base import ProviderUnavailable
from mvp_core.vastai_env import VastAiEnvError, VastAiEnvironment


def settings() -> VastAiEnvironment:
    """This worker's Vast.ai settings (mvp_core/vastai_env.py); ProviderUnavailable when
    one is unusable."""
    try:
        return VastAiEnvironment.from_env(os.environ)
    except VastAiEnvError as err:
        raise ProviderUnavailable(str(err)) from None


def server_url() -> str:
    return settings().server_url


def identity_path() -> Path:
    return settings().ssh_identity.expanduser()
