"""The shared I/O floor: files, sockets and processes that more than one room needs.

Beside ``temporal/`` and under ``activities/`` and ``workers/``: the run's datastream
(``mvp_io.datastream``), the model store (``mvp_io.model_store``) and the scan of a
host's node processes (``mvp_io.node_processes``). It imports only ``mvp_core`` and
libraries, never an activity, a workflow, a process's room or Temporal.
"""
