"""The orchestrator worker (``python -m workers.orchestrator``): it hosts the run, prompt
and reaper workflows and the orchestrator's activities, and keeps the reaper's schedule."""
