"""The run datastream activity's input, and its signal of where the live frames are
served."""

from __future__ import annotations

from mvp_core.models._base import _Model
from mvp_core.models.provider_settings import ProviderKind


class RunDatastreamInput(_Model):
    """The run datastream activity's input (activities/datastream.py): which run."""

    run_id: int
    run_workflow_id: str
    provider: ProviderKind
    # The execution's nonce (already in history with every NodeProvisionSpec): the
    # activity derives the run's edge token from it, to keep it out of the records.
    nonce: str = ""


class DatastreamAddress(_Model):
    """Signal from the run's datastream activity: where its live frames are served
    (``127.0.0.1:<port>`` or ``unix:<path>``) and where its frame archive is written, on
    ``host``. A later one (an activity retry, a continued run) replaces the earlier."""

    run_id: int
    address: str
    archive: str
    host: str = ""
    attempt: int = 1
