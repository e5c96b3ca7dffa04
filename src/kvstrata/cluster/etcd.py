"""``etcd://``: a cluster's member list in etcd v3, through its JSON gateway (the ``etcd3gw`` client).

Each member is one key, ``/kvstrata/NAME/members/NODE_ID``, holding its :class:`Member` as JSON and tied to a
lease the worker renews every ``ttl/3`` seconds from a background thread: when the worker dies the lease runs
out and etcd deletes the key. The key is created in a transaction only where it is absent, so two workers can't
take one node id. A renewal that finds the lease gone (etcd was out of reach longer than ``ttl``) lists the
member again under a new lease. Watchers re-read the list after each change etcd reports, watching from the revision
each read saw (so no change slips in between), and at least every ``refresh_s``; each watch has its own connections.

Several endpoints (``etcd://h1:2379,h2:2379/NAME``) are tried in turn when one cannot be reached.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstrata.cluster.membership import DEFAULT_TTL_S, Member, Membership, Watcher, check_ttl
from kvstrata.errors import ClosedError, InvalidValue, KeyExists, TransportError

log = logging.getLogger(__name__)

KEY_ROOT = "/kvstrata"
DEFAULT_NAME = "kvstrata"
#: the longest a watcher goes without re-reading the list (a change between a read and the next watch waits this)
REFRESH_S = 2.0


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://HOST:PORT[,HOST:PORT...][/NAME]`` -> (endpoints, NAME). Port defaults to 2379, NAME to kvstrata."""
    rest = url.removeprefix("etcd://")
    hosts, _, name = rest.partition("/")
    name = name.strip("/") or DEFAULT_NAME
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise InvalidValue(f"cluster: name {name!r} in {url!r} must be letters, digits and -_. (no /)")
    endpoints = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = part.strip(), "2379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidValue(f"cluster: endpoint {part!r} in {url!r} is not HOST:PORT")
        endpoints.append((host, int(port)))
    return endpoints, name


def _on(lease: Any, client: Any) -> Any:
    """``lease`` sent through ``client`` (etcd3gw's leases keep the client that granted them; any endpoint of the
    etcd cluster knows them)."""
    lease.client = client
    return lease


class EtcdMembership(Membership):
    """A view of the member list of the kvstrata cluster ``NAME`` in etcd (see the module's docstring)."""

    def __init__(self, url: str, *, timeout: float = 5.0, refresh_s: float = REFRESH_S) -> None:
        try:
            import etcd3gw  # noqa: F401
        except ImportError as exc:  # (an optional dependency: pip install 'kvstrata[cluster]')
            raise ImportError("etcd:// clusters need the etcd3gw package: pip install 'kvstrata[cluster]'") from exc
        from etcd3gw import exceptions

        self._url = url
        self._endpoints, self.name = parse_etcd_url(url)
        self.prefix = f"{KEY_ROOT}/{self.name}/members/"
        self._prefix_end = self.prefix[:-1] + chr(ord(self.prefix[-1]) + 1)  # (the end of the prefix's key range)
        self._timeout = timeout
        self._refresh_s = refresh_s
        self._clients = [self._new_client(h, p) for h, p in self._endpoints]
        self._current = 0  # the endpoint that answered last
        self._unreachable = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError)
        self._lock = threading.Lock()
        self._member: Member | None = None
        self._lease: Any = None
        self._ttl = DEFAULT_TTL_S
        self._stop_renewing = threading.Event()
        self._renewer: threading.Thread | None = None
        self._watches: list[_Watch] = []
        self._closed = False
        self._call(lambda client: client.status())  # (fails here, naming etcd, rather than at the first use)

    @property
    def url(self) -> str:
        return self._url

    def _new_client(self, host: str, port: int) -> Any:
        import etcd3gw

        return etcd3gw.client(host=host, port=port, timeout=self._timeout)

    def _call(self, fn: Callable[[Any], Any], watch: _Watch | None = None) -> Any:
        """``fn(client)`` on the endpoint that answered last, then on each other one; TransportError naming them all
        when none answers. ``watch``: on that watch's own clients."""
        clients = self._clients if watch is None else watch.clients
        current = self._current if watch is None else watch.current
        errors = []
        for step in range(len(clients)):
            i = (current + step) % len(clients)
            try:
                result = fn(clients[i])
            except self._unreachable as exc:
                host, port = self._endpoints[i]
                errors.append(f"{host}:{port}: {str(exc)[:200]}")
                continue
            if watch is None:
                self._current = i
            else:
                watch.current = i
            return result
        raise TransportError(f"cannot reach etcd for cluster {self._url}: " + "; ".join(errors))

    # joining -----------------------------------------------------------------------------------------
    def join(self, member: Member, *, ttl: float = DEFAULT_TTL_S) -> None:
        ttl = check_ttl(ttl)
        if self._closed:
            raise ClosedError(f"membership view of {self._url} is closed")
        if self._member is not None:
            raise InvalidValue(f"this membership view already joined {self._url} as {self._member.node_id!r}")
        lease = self._list(member, ttl)
        if lease is None:
            held = self.members().get(member.node_id)
            where = f" (listed at {held.address}, pid {held.info.get('pid')})" if held else ""
            raise KeyExists(f"node id {member.node_id!r} is already a member of {self._url}{where}")
        stop = threading.Event()  # (this join's: a renewer of an earlier join that is still ending stays stopped)
        with self._lock:
            self._member, self._lease, self._ttl, self._stop_renewing = member, lease, ttl, stop
        self._renewer = threading.Thread(
            target=self._renew, args=(member, ttl, stop), name=f"kvstrata-etcd-lease {member.node_id}", daemon=True
        )
        self._renewer.start()

    def _list(self, member: Member, ttl: float) -> Any:
        """Put ``member``'s key under a new lease where the key is absent: the lease, or None (taken)."""
        lease = self._call(lambda client: client.lease(ttl=max(1, math.ceil(ttl))))
        key = self.prefix + member.node_id
        try:
            created = self._call(lambda client: client.create(key, member.to_json(), lease))
            if not created:  # (a create that timed out on one endpoint, then retried on the next, may be ours)
                entries = self._call(lambda client: client.get(key, metadata=True))
                created = any(str(meta.get("lease")) == str(lease.id) for _, meta in entries)
        except BaseException:
            created = False
            raise
        finally:
            if not created:
                with contextlib.suppress(Exception):
                    self._call(lambda client: _on(lease, client).revoke())
        return lease if created else None

    def _renew(self, member: Member, ttl: float, stop: threading.Event) -> None:
        """Renew the lease every ttl/3 until :meth:`leave` sets ``stop``; list the member again if the lease ran
        out (and take that listing back at once where leave() came meanwhile)."""
        failing_since = None
        while not stop.wait(ttl / 3):
            with self._lock:
                lease = self._lease
            if lease is None:
                return
            try:
                left = self._call(lambda client, lease=lease: _on(lease, client).refresh())
                if left <= 0 and stop.is_set():  # (leave() revoked it)
                    return
                if left <= 0:  # etcd forgot the lease (out of reach past ttl): the key went with it
                    log.warning("the lease of %s in %s ran out: listing it again", member.node_id, self._url)
                    relisted = self._list(member, ttl)
                    if relisted is None:
                        log.error(
                            "node id %s was taken in %s while this worker's lease was out: it is no longer listed",
                            member.node_id,
                            self._url,
                        )
                        return
                    with self._lock:  # (leave() sets stop before it takes the lease under this lock)
                        left_meanwhile = stop.is_set()
                        if not left_meanwhile:
                            self._lease = relisted
                    if left_meanwhile:
                        self._call(lambda client, lease=relisted: _on(lease, client).revoke())
                        return
                if failing_since is not None:
                    log.info("etcd answers again: %s stays listed in %s", member.node_id, self._url)
                failing_since = None
            except Exception as exc:  # (out of reach for now: keep trying; the lease lasts ttl)
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("cannot renew the lease of %s in %s: %s", member.node_id, self._url, exc)

    def leave(self) -> None:
        with self._lock:
            self._stop_renewing.set()
            lease, self._lease, self._member = self._lease, None, None
        renewer, self._renewer = self._renewer, None
        if lease is not None:
            try:
                self._call(lambda client: _on(lease, client).revoke())  # (deletes the key at once)
            except Exception as exc:  # its ttl takes it off instead
                log.warning("could not leave %s at once (%s): the entry lapses within its ttl", self._url, exc)
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join(timeout=self._timeout + 1)

    # reading -----------------------------------------------------------------------------------------
    def members(self) -> dict[str, Member]:
        return self._read()[0]

    def _read(self, watch: _Watch | None = None) -> tuple[dict[str, Member], int]:
        """The live members, and the etcd revision they were read at."""
        if self._closed:
            raise ClosedError(f"membership view of {self._url} is closed")
        request = {"key": _b64(self.prefix), "range_end": _b64(self._prefix_end)}
        result = self._call(lambda client: client.post(client.get_url("/kv/range"), json=request), watch)
        revision = int(result.get("header", {}).get("revision", 0))
        out: dict[str, Member] = {}
        for entry in result.get("kvs", []):
            try:
                member = Member.from_json(base64.b64decode(entry.get("value", "")))
            except InvalidValue as exc:  # (written by something else: skipped, not fatal to every client)
                log.warning("skipping an entry in %s: %s", self._url, exc)
                continue
            out[member.node_id] = member
        return out, revision

    def watch(self, callback: Watcher) -> Callable[[], None]:
        if self._closed:
            raise ClosedError(f"membership view of {self._url} is closed")
        stopped = threading.Event()
        watch = _Watch(stopped, [self._new_client(h, p) for h, p in self._endpoints])
        thread = threading.Thread(
            target=self._watch_loop, args=(callback, watch), name=f"kvstrata-etcd-watch {self.name}", daemon=True
        )
        watch.thread = thread
        with self._lock:
            self._watches.append(watch)
        thread.start()
        return watch.stop

    def _watch_loop(self, callback: Watcher, watch: _Watch) -> None:
        """Read the list, call ``callback`` if it changed, wait for etcd's next change to it (or ``refresh_s``);
        on clients of its own, so that ending a watch's stream never touches a connection another thread uses."""
        last: dict[str, Member] | None = None
        try:
            while not watch.stopped.is_set():
                try:
                    now, revision = self._read(watch)
                except Exception as exc:
                    if watch.stopped.is_set() or self._closed:
                        return
                    log.warning("cannot read the members of %s: %s", self._url, exc)
                    watch.stopped.wait(min(self._refresh_s, 1.0))
                    continue
                if watch.stopped.is_set():
                    return
                if now != last:
                    last = now
                    try:
                        callback(now)
                    except Exception:
                        log.exception("a watcher of %s failed", self._url)
                self._wait_for_change(watch, revision + 1)
        finally:
            for client in watch.clients:
                with contextlib.suppress(Exception):
                    client.session.close()

    def _wait_for_change(self, watch: _Watch, start_revision: int) -> None:
        """Until etcd reports a change of the list from ``start_revision`` on (so none slips in after the read),
        ``refresh_s`` passes with no word from etcd, the stream fails, or the watch stops."""
        client = watch.clients[watch.current]
        request = {"create_request": {"key": _b64(self.prefix), "range_end": _b64(self._prefix_end)}}
        request["create_request"]["start_revision"] = start_revision
        try:
            response = client.session.post(
                client.get_url("/watch"), json=request, stream=True, timeout=(self._timeout, self._refresh_s)
            )
        except Exception:  # (out of reach: the next read says so, and moves on to another endpoint)
            watch.stopped.wait(min(self._refresh_s, 1.0))
            return
        with watch.lock:
            watch.response = response
        try:
            if watch.stopped.is_set() or response.status_code != 200:
                return
            for line in response.iter_lines():
                if watch.stopped.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("events") or result.get("canceled") or "compact_revision" in result:
                    return  # (a change, or etcd ended the watch: compacted past start_revision)
        except Exception:  # (no word in refresh_s, the stream cut, or stop() shut it): read the list again
            return
        finally:
            with watch.lock:
                watch.response = None
            with contextlib.suppress(Exception):
                response.close()

    def close(self) -> None:
        if self._closed:
            return
        self.leave()
        self._closed = True
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.stop()
        for watch in watches:
            if watch.thread is not None and watch.thread is not threading.current_thread():
                watch.thread.join(timeout=self._timeout + 1)
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.session.close()


class _Watch:
    """One :meth:`EtcdMembership.watch`: its stop flag, thread, etcd clients and the watch stream it waits on."""

    def __init__(self, stopped: threading.Event, clients: list[Any]) -> None:
        self.stopped = stopped
        self.clients = clients
        self.current = 0  # the endpoint that answered last
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.response: Any = None

    def stop(self) -> None:
        """Stop the calls; a wait on etcd's stream ends now (its socket shut), not at ``refresh_s``."""
        self.stopped.set()
        with self.lock:
            response = self.response
        if response is not None:
            with contextlib.suppress(Exception):
                response.raw.connection.sock.shutdown(socket.SHUT_RDWR)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
