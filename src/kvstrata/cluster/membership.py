"""Who is in a cluster: the live workers, each under a node id, with the address clients reach it at.

A worker :meth:`~Membership.join` s on start and stays listed while it lives: its entry is held by a lease
that it keeps renewing, so a worker that dies (SIGKILL, its host gone) drops out of the list once the lease
runs out (``ttl`` seconds), and one that stops cleanly :meth:`~Membership.leave` s at once. Clients read the
list (:meth:`~Membership.members`) and are told of each change (:meth:`~Membership.watch`).

One interface, backends picked by the address's scheme (as :mod:`kvstrata.transport` picks transports):

- ``etcd://HOST:PORT[,HOST:PORT...]/NAME``: an etcd v3 cluster (:mod:`kvstrata.cluster.etcd`); ``NAME`` keeps
  several kvstrata clusters apart in one etcd (default ``kvstrata``). ``etcds://``: the same over TLS, with
  ``?cacert=PATH&cert=PATH&key=PATH``; ``?user=NAME`` (either scheme) with the password in
  ``$KVSTRATA_ETCD_PASSWORD`` for etcd's auth (:mod:`kvstrata.cluster.etcd` says more).
- ``inproc://NAME``: a list in this process, for tests and for workers run inside one program.

>>> registry = open_membership("inproc://doc")
>>> registry.join(Member("node-a", "tcp://10.0.0.1:7390"), ttl=5)
>>> sorted(open_membership("inproc://doc").members())
['node-a']
>>> registry.leave(); registry.close()
"""

from __future__ import annotations

import abc
import json
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstrata.errors import ClosedError, InvalidType, InvalidValue, KeyExists

#: a node id: what a worker is listed under (default ``HOST:PORT`` of its TCP listener)
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-\[\]]{0,199}")
DEFAULT_TTL_S = 10.0
MIN_TTL_S = 1.0  # etcd's leases are granted in whole seconds, and a renewal each ttl/3 must fit in one

Watcher = Callable[[dict[str, "Member"]], None]


@dataclass(frozen=True)
class Member:
    """One worker of a cluster.

    ``node_id``: its name in the cluster; ``address``: where any client reaches it (``tcp://HOST:PORT``);
    ``socket``: its Unix socket, for clients on its own host (``host``), which then share its memory;
    ``info``: what it says of itself (memory and disk sizes, pid, version), for ``kvstrata status``.
    """

    node_id: str
    address: str
    socket: str = ""
    host: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        if not isinstance(self.address, str) or not self.address.startswith("tcp://"):
            raise InvalidValue(f"address: a member is reached at a tcp://HOST:PORT address, got {self.address!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        """A member from its stored entry; InvalidValue naming what is wrong with a malformed one."""
        try:
            fields = json.loads(text)
            return cls(
                node_id=fields["node_id"],
                address=fields["address"],
                socket=fields.get("socket", ""),
                host=fields.get("host", ""),
                info=dict(fields.get("info") or {}),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidValue(f"malformed member entry {text[:200]!r}: {exc}") from exc


def check_node_id(node_id: Any) -> str:
    if not isinstance(node_id, str):
        raise InvalidType(f"node_id: must be a str, got {type(node_id).__name__}")
    if not NODE_ID_PATTERN.fullmatch(node_id):
        raise InvalidValue(
            f"node_id: {node_id!r} must be 1-200 characters of letters, digits and _.:-[] starting with a letter or "
            "digit"
        )
    return node_id


def check_ttl(ttl: Any) -> float:
    if type(ttl) not in (int, float) or not ttl >= MIN_TTL_S or ttl != ttl or ttl == float("inf"):
        raise InvalidValue(f"ttl: must be a number of seconds of at least {MIN_TTL_S:g}, got {ttl!r}")
    return float(ttl)


class Membership(abc.ABC):
    """A view of one cluster's member list; joins it as at most one member (a worker's)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The address this view was opened with (``etcd://...``, ``etcds://...``, ``inproc://...``)."""

    @abc.abstractmethod
    def join(self, member: Member, *, ttl: float = DEFAULT_TTL_S) -> None:
        """List ``member`` until :meth:`leave` (renewed in the background), or until this process has been gone
        ``ttl`` seconds. KeyExists if a live member already has its node id; InvalidValue if this view joined."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Take this view's member off the list now (no-op if it did not join)."""

    @abc.abstractmethod
    def members(self) -> dict[str, Member]:
        """The live members by node id, read now."""

    @abc.abstractmethod
    def watch(self, callback: Watcher) -> Callable[[], None]:
        """Call ``callback(members)`` on a background thread after each change of the list (and may call it when
        nothing changed); returns a function that stops the calls."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave, stop watches and free the connection (idempotent)."""

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class _InProcessList:
    """One ``inproc://`` cluster's members, shared by every view opened on its name in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.members: dict[str, Member] = {}
        self.watchers: list[Watcher] = []

    def changed(self) -> None:
        with self.lock:
            members, watchers = dict(self.members), list(self.watchers)
        for callback in watchers:
            callback(members)


_INPROC: dict[str, _InProcessList] = {}
_INPROC_LOCK = threading.Lock()


class InProcessMembership(Membership):
    """``inproc://NAME``: a member list held in this process (no lease: a member stays until it leaves, or a test
    calls :meth:`expire`, which is what a dead worker's lease running out looks like). Watchers are called
    synchronously, on the thread that changed the list."""

    def __init__(self, name: str) -> None:
        if not name:
            raise InvalidValue("inproc:// membership needs a name: inproc://NAME")
        self._name = name
        with _INPROC_LOCK:
            self._list = _INPROC.setdefault(name, _InProcessList())
        self._joined: str | None = None
        self._watches: list[Watcher] = []
        self._closed = False

    @property
    def url(self) -> str:
        return f"inproc://{self._name}"

    def join(self, member: Member, *, ttl: float = DEFAULT_TTL_S) -> None:
        check_ttl(ttl)
        self._check_open()
        if self._joined is not None:
            raise InvalidValue(f"this membership view already joined {self.url} as {self._joined!r}")
        with self._list.lock:
            if member.node_id in self._list.members:
                raise KeyExists(f"node id {member.node_id!r} is already a member of {self.url}")
            self._list.members[member.node_id] = member
        self._joined = member.node_id
        self._list.changed()

    def leave(self) -> None:
        node, self._joined = self._joined, None
        if node is None:
            return
        with self._list.lock:
            self._list.members.pop(node, None)
        self._list.changed()

    def expire(self, node_id: str) -> None:
        """Drop ``node_id`` as its lease running out would (for tests of a worker that died)."""
        with self._list.lock:
            self._list.members.pop(node_id, None)
        if self._joined == node_id:
            self._joined = None
        self._list.changed()

    def members(self) -> dict[str, Member]:
        self._check_open()
        with self._list.lock:
            return dict(self._list.members)

    def watch(self, callback: Watcher) -> Callable[[], None]:
        self._check_open()
        with self._list.lock:
            self._list.watchers.append(callback)
        self._watches.append(callback)

        def cancel() -> None:
            with self._list.lock:
                if callback in self._list.watchers:
                    self._list.watchers.remove(callback)

        return cancel

    def close(self) -> None:
        if self._closed:
            return
        self.leave()
        with self._list.lock:
            for callback in self._watches:
                if callback in self._list.watchers:
                    self._list.watchers.remove(callback)
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"membership view of {self.url} is closed")


def advertised_address(listen_address: str) -> str:
    """The address other hosts reach a ``tcp://`` listener at: its own, with a wildcard host (``0.0.0.0``, ``::``)
    replaced by this host's address on the route out (its hostname's where there is no route; 127.0.0.1 last)."""
    import socket

    host, _, port = listen_address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if host not in ("", "0.0.0.0", "::"):
        return listen_address
    found = ""
    try:  # (a UDP socket "connected" to an outside address sends nothing; it only picks the route's source address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never a real peer
            found = probe.getsockname()[0]
    except OSError:
        try:
            found = socket.gethostbyname(socket.gethostname())
        except OSError:
            found = ""
    return f"tcp://{found or '127.0.0.1'}:{port}"


def open_membership(url: str, *, timeout: float = 5.0) -> Membership:
    """A view of the cluster at ``url``: ``etcd://HOST:PORT[,HOST:PORT...][/NAME]``, ``etcds://`` (the same over
    TLS; certificates and user as :mod:`kvstrata.cluster.etcd` says) or ``inproc://NAME``.

    ``timeout``: seconds each request to etcd may take. An etcd that cannot be reached raises
    :class:`~kvstrata.errors.TransportError` naming it; a malformed address, a missing certificate file or a user
    etcd refuses, :class:`~kvstrata.errors.InvalidValue`.
    """
    if not isinstance(url, str):
        raise InvalidType(f"cluster: must be an address str, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidValue(f"cluster: {url!r} has no scheme (etcd://HOST:PORT/NAME, etcds://... or inproc://NAME)")
    if scheme == "inproc":
        return InProcessMembership(rest)
    if scheme in ("etcd", "etcds"):
        from kvstrata.cluster.etcd import EtcdMembership

        return EtcdMembership(url, timeout=timeout)
    raise InvalidValue(f"cluster: unknown scheme {scheme!r} in {url!r} (etcd://, etcds:// or inproc://)")
