"""Data plane of a pipeline run: edge records (CONTRACTS.md) and authenticated TCP edges.

Pure stdlib + numpy: nothing here imports torch, so edge threads stay light.

TCP pipeline edges: authenticated, deadline-bounded, one direction per connection.
Blocking sockets in dedicated threads (the lowest-latency option next to a torch engine
that holds the GIL only in short stretches), TCP_NODELAY on both ends. The downstream end
listens (`DataPlaneServer`, server.py, from boot: DECISIONS 6); the upstream end connects
(`connect_edge`, sender.py) and sends a hello carrying the edge id and the run's edge token
(handshake.py); after that, records (records.py) flow upstream -> downstream only
(receiver.py). Any error on any edge of a stage closes all of that stage's edges
(`EdgeGroup`, group.py) so the driver sees EOF within milliseconds (DECISIONS 20).
"""

from mvp_core.edge_auth import HELLO_MAGIC

from . import records
from .errors import EdgeAuthError, EdgeClosed, EdgeError, EdgeTimeout
from .group import Edge, EdgeGroup
from .receiver import EdgeReceiver
from .records import *  # noqa: F403  (the public names: records.__all__)
from .sender import EdgeSender, connect_edge
from .server import DataPlaneServer

__all__ = [
    "HELLO_MAGIC",
    "DataPlaneServer",
    "Edge",
    "EdgeAuthError",
    "EdgeClosed",
    "EdgeError",
    "EdgeGroup",
    "EdgeReceiver",
    "EdgeSender",
    "EdgeTimeout",
    "connect_edge",
]
__all__ += records.__all__
