"""Message transports between kvstrata clients and workers, chosen by address scheme.

``unix:///path.sock`` (node-local, passes file descriptors), ``inproc://name`` (threads of one
process), ``tcp://host:port`` (between nodes). See :mod:`kvstrata.transport.base` for the contract.
"""

from kvstrata.transport import inproc as _inproc  # noqa: F401 - registers inproc://
from kvstrata.transport import sockets as _sockets  # noqa: F401 - registers unix:// and tcp://
from kvstrata.transport.base import (
    PROTOCOL_VERSION,
    Backend,
    Connection,
    Listener,
    Message,
    register_backend,
    split_address,
)
from kvstrata.transport.core import connect, listen

__all__ = [
    "PROTOCOL_VERSION",
    "Backend",
    "Connection",
    "Listener",
    "Message",
    "connect",
    "listen",
    "register_backend",
    "split_address",
]
