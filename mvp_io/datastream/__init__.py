"""A run's datastream: publish records, fan frames out to sinks, never block.

Used by the run datastream activity (``activities/datastream.py``) and the process host.

``Datastream.publish`` redacts a record, turns it into a frame of its stream (channel id,
position, arrival time; ``mvp_core.datastream``) and offers it to every sink. A sink owns
a bounded queue and its own thread: when the queue is full the frame is dropped for that
sink and counted, so a slow disk or a stuck subscriber never slows the run (the
datastream is observational, process spec 8.15, 9.18). ``close`` flushes with a bound.

One module per job, re-exported here: ``sinks`` (the bounded queue every sink has),
``archive``, ``live_subscribers``, ``publisher`` (``Datastream``), ``tailer``,
``node_follower``, ``address``.

Sinks:

- ``FrameArchive(path)``: the frame archive (process spec 7.13, 8.12): JSON lines,
  appended, parent directories made, flushed after each line; ``arrival_seq`` continues
  from the existing file's line count.
- ``LiveSubscribers(address)``: a loopback TCP (``127.0.0.1:<port>``, 0 = any free port)
  or unix-socket (``unix:<path>``) server; every attached subscriber gets every frame from
  attach time on, as the archive's JSON lines (``arrival_seq`` there is the datastream's
  publish sequence, so a gap shows what that subscriber lost). A subscriber that does not
  keep up loses frames (counted), it never slows the others or the run.

``LogTailer`` follows a node's log file and publishes its lines as log records;
``NodeFollower`` follows a node's own datastream on its data-plane port and passes its
frames on (``Datastream.relay``, DECISIONS 93).
``workers/host/follow.py`` is the subscriber side; ``activities/datastream.py`` the run's activity (``python -m workers.host.follow``).

Host wiring (sketch)::

    redactor = Redactor.from_env(os.environ, extra=[vastai_api_key])
    sinks = [FrameArchive(path)] if frame_log else []
    live = LiveSubscribers("127.0.0.1:0"); sinks.append(live)
    ds = Datastream(run_id=run_id, node_id=node_id, sinks=sinks, redactor=redactor)
    ds.bootstrap("config", "ready", {"provider": "process", "vastai_api_key": bool(key)})
    tail = LogTailer(ds, handle.log_path, node_id=3).start()
    ...
    tail.stop(); ds.close()
"""

from __future__ import annotations

from mvp_io.datastream.address import format_address, parse_address
from mvp_io.datastream.archive import FrameArchive, read_frame_lines
from mvp_io.datastream.live_subscribers import LiveSubscribers
from mvp_io.datastream.node_follower import NodeFollower
from mvp_io.datastream.publisher import DEFAULT_SUMMARY_INTERVAL_S, Datastream
from mvp_io.datastream.sinks import DEFAULT_CLOSE_TIMEOUT_S, DEFAULT_QUEUE_FRAMES, Sink
from mvp_io.datastream.tailer import LogTailer

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT_S",
    "DEFAULT_QUEUE_FRAMES",
    "DEFAULT_SUMMARY_INTERVAL_S",
    "Datastream",
    "FrameArchive",
    "LiveSubscribers",
    "LogTailer",
    "NodeFollower",
    "Sink",
    "format_address",
    "parse_address",
    "read_frame_lines",
]
