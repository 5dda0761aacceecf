"""The run lifecycle: ``RunWorkflow`` (workflow.py, whose ``run`` is the table of
contents) and one module per phase.

- ``planning``: the provider queue and a committed plan (a failure is a rejection)
- ``startup``: nodes started, the readiness barrier, stages provisioned, prompt-ready
- ``membership``: leases and the provider watch; a loss goes to ``on_loss``
- ``recovery``: a lost node replaced, a new pipeline, prompts kept (DECISIONS 68)
- ``serve``: prompts activated in their turn; rolling over to continue-as-new
- ``prompts``, ``admission``: a prompt admitted, served and ended; the Update validators
- ``faults``: a survivor's fault report, confirmed after a grace
- ``signals``: every signal decoded, a node's report to its ``RunState`` rule
- ``teardown``: StopRun, StageStopped, provider stops, RunTornDown once
- ``datastream``, ``view``: the run's datastream activity; its phase and details
- ``carry``, ``context``: the start input and continue-as-new; what the phases share
"""

from workflows.run.workflow import RunWorkflow

__all__ = ["RunWorkflow"]
