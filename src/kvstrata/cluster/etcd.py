"""``etcd://``: a cluster's member list in etcd v3, through its JSON gateway (the ``etcd3gw`` client).

Each member is one key, ``/kvstrata/NAME/members/NODE_ID``, holding its :class:`Member` as JSON and tied to a
lease the worker renews every ``ttl/3`` seconds from a background thread: when the worker dies the lease runs
out and etcd deletes the key. The key is created in a transaction only where it is absent, so two workers can't
take one node id. A renewal that finds the lease gone (etcd was out of reach longer than ``ttl``) lists the
member again under a new lease. Watchers re-read the list after each change etcd reports, watching from the revision
each read saw (so no change slips in between), and at least every ``refresh_s``; each watch has its own connections.

Several endpoints (``etcd://h1:2379,h2:2379/NAME``) are tried in turn when one cannot be reached.

Security, as production etcd deployments have it (the options are etcdctl's):

- ``etcds://HOST:PORT[,HOST:PORT...][/NAME]``: the same over HTTPS. ``?cacert=PATH`` verifies etcd's certificate
  (default: requests' CAs), ``?cert=PATH&key=PATH`` is a client certificate (etcd's ``--client-cert-auth``); each,
  where absent from the address, comes from ``$KVSTRATA_ETCD_CACERT``, ``$KVSTRATA_ETCD_CERT``, ``$KVSTRATA_ETCD_KEY``.
- User and password (etcd's ``--auth``): ``?user=NAME`` or ``$KVSTRATA_ETCD_USER``, on either scheme; the password
  only from ``$KVSTRATA_ETCD_PASSWORD``, never in the address (which shows in logs, stats and ``ps``). Each
  connection gets a token (:class:`EtcdSession`) and gets a new one when etcd drops it (its TTL ran out, auth was
  turned off and on, etcd restarted).

``etcds://10.0.0.1:2379/kv?cacert=/etc/etcd/ca.pem&cert=/etc/etcd/kv.pem&key=/etc/etcd/kv-key.pem``
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.cluster.membership import DEFAULT_TTL_S, Member, Membership, Watcher, check_ttl
from kvstrata.errors import ClosedError, InvalidValue, KeyExists, TransportError

try:
    from requests import Session as _Session
except ImportError:  # (requests comes with etcd3gw, the optional dependency: EtcdMembership says to install it)
    _Session = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

KEY_ROOT = "/kvstrata"
DEFAULT_NAME = "kvstrata"
#: the longest a watcher goes without re-reading the list (a change between a read and the next watch waits this)
REFRESH_S = 2.0


#: where the TLS files and the user come from when the address does not say (the password: only from there)
ENV_CACERT = "KVSTRATA_ETCD_CACERT"
ENV_CERT = "KVSTRATA_ETCD_CERT"
ENV_KEY = "KVSTRATA_ETCD_KEY"
ENV_USER = "KVSTRATA_ETCD_USER"
ENV_PASSWORD = "KVSTRATA_ETCD_PASSWORD"
_TLS_PARAMETERS = {"cacert": ENV_CACERT, "cert": ENV_CERT, "key": ENV_KEY}
_PARAMETERS = (*_TLS_PARAMETERS, "user")


@dataclass(frozen=True)
class EtcdAddress:
    """An ``etcd://`` or ``etcds://`` address taken apart (no password: that is never in an address).

    ``cacert``, ``cert``, ``key``, ``user``: "" where not given; ``sources``: where each given one came from
    (``?cert=`` or ``$KVSTRATA_ETCD_CERT``), for messages.
    """

    endpoints: tuple[tuple[str, int], ...]
    name: str
    tls: bool
    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    sources: tuple[tuple[str, str], ...] = ()

    def source(self, parameter: str) -> str:
        """Where ``parameter`` (cacert, cert, key, user) came from: ``?cert=`` or ``$KVSTRATA_ETCD_CERT``."""
        return dict(self.sources).get(parameter, f"?{parameter}=")

    def check_files(self) -> None:
        """InvalidValue naming the parameter and the path of a certificate or key file that cannot be read."""
        for parameter in _TLS_PARAMETERS:
            path = getattr(self, parameter)
            if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                what = "does not exist" if not os.path.exists(path) else "is not a readable file"
                raise InvalidValue(f"cluster: {parameter} file {path!r} (from {self.source(parameter)}) {what}")


def parse_etcd_address(url: str, environ: Mapping[str, str] | None = None) -> EtcdAddress:
    """``etcd[s]://HOST:PORT[,HOST:PORT...][/NAME][?cacert=PATH&cert=PATH&key=PATH&user=NAME]`` taken apart, with
    what the address leaves out taken from ``environ`` (default ``os.environ``; see the module's docstring). Port
    defaults to 2379, NAME to kvstrata. InvalidValue, naming what is wrong (and never a secret), for a malformed
    address, an unknown parameter, a TLS parameter on ``etcd://``, or a client certificate without its key.

    >>> a = parse_etcd_address("etcds://10.0.0.1,10.0.0.2:2380/kv?cacert=/etc/ca.pem", environ={})
    >>> a.endpoints, a.name, a.tls, a.cacert, a.cert
    ((('10.0.0.1', 2379), ('10.0.0.2', 2380)), 'kv', True, '/etc/ca.pem', '')
    """
    environ = os.environ if environ is None else environ
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise InvalidValue(f"cluster: {url!r} is not an etcd://HOST:PORT[/NAME] or etcds://HOST:PORT[/NAME] address")
    tls = scheme == "etcds"
    rest, _, query = rest.partition("?")
    hosts, _, name = rest.partition("/")
    # (the messages below leave the address out where it could hold a secret someone put there by mistake)
    if "@" in hosts:
        raise InvalidValue(
            "cluster: no USER:PASSWORD@ in an etcd address (it shows in logs, stats and ps): give ?user=NAME or "
            f"${ENV_USER}, and the password in ${ENV_PASSWORD}"
        )
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidValue("cluster: the address's query must be NAME=VALUE pairs joined by &") from None
    given: dict[str, str] = {}
    for key, value in pairs:
        if key.lower() in ("password", "pass", "passwd", "pwd"):
            raise InvalidValue(
                f"cluster: the etcd password never goes in the address (it shows in logs, stats and ps): set "
                f"${ENV_PASSWORD}"
            )
        if key in given:
            raise InvalidValue(f"cluster: parameter {key!r} is given twice in the address")
        given[key] = value
    unknown = sorted(set(given) - set(_PARAMETERS))
    if unknown:
        raise InvalidValue(
            f"cluster: unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in the "
            f"etcd address (known: {', '.join(_PARAMETERS)})"
        )
    for key, value in given.items():
        if not value.strip():
            raise InvalidValue(f"cluster: parameter {key!r} is empty in the etcd address")
    if not tls and given.keys() & _TLS_PARAMETERS.keys():
        tls_given = ", ".join(sorted(given.keys() & _TLS_PARAMETERS.keys()))
        raise InvalidValue(
            f"cluster: {tls_given} (TLS) in {url!r}, an etcd:// address (plain HTTP): write etcds:// to reach etcd "
            "over HTTPS"
        )
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
    values: dict[str, str] = {}
    sources = []
    # (the TLS files from the environment only over TLS: one environment may serve etcd:// addresses too)
    for key, env in (*(_TLS_PARAMETERS.items() if tls else ()), ("user", ENV_USER)):
        if key in given:
            values[key], where = given[key], f"?{key}="
        elif environ.get(env, "").strip():
            values[key], where = environ[env], f"${env}"
        else:
            continue
        if key != "user":
            values[key] = os.path.expanduser(values[key].strip())
        sources.append((key, where))
    address = EtcdAddress(tuple(endpoints), name, tls, sources=tuple(sources), **values)
    if bool(address.cert) != bool(address.key):
        have, lacks = ("cert", "key") if address.cert else ("key", "cert")
        raise InvalidValue(
            f"cluster: a client certificate needs both cert and key: {have} is given ({address.source(have)}), "
            f"{lacks} is not (?{lacks}= or ${_TLS_PARAMETERS[lacks]})"
        )
    return address


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd[s]://HOST:PORT[,HOST:PORT...][/NAME][?...]`` -> (endpoints, NAME). Port defaults to 2379, NAME to
    kvstrata (see :func:`parse_etcd_address` for the rest)."""
    address = parse_etcd_address(url)
    return list(address.endpoints), address.name


#: etcd's answers (HTTP 400, the gateway's code 3) where a request came with no token (etcd's auth was turned on
#: after this connection got none) or one older than etcd's auth settings: a new token is the cure, as for a 401
_GET_A_TOKEN = (b"user name is empty", b"revision of auth store is old")


class EtcdSession(_Session):
    """The HTTP session of one etcd3gw client (``etcd3gw.client(..., session=...)``, then :meth:`attach`): the TLS
    settings on every request, and with a ``user``, etcd's auth token.

    The token is got (``POST /v3/auth/authenticate``) at the first request, sent as the ``Authorization`` header of
    each, and got again, once, when etcd answers that it is not valid: 401 ``etcdserver: invalid auth token``
    (its TTL ran out, auth was turned off and on, etcd restarted: simple tokens live in one etcd member's memory,
    which is why each endpoint's client has its own session). Where etcd's auth is off, requests go without a token.
    Thread-safe: one thread gets a new token while the others that found theirs stale wait for it.
    Wrong credentials: InvalidValue naming the user (never the password).
    """

    def __init__(
        self,
        *,
        cacert: str = "",
        cert: tuple[str, str] | None = None,
        user: str = "",
        password: str = "",
        timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self._cacert = cacert
        if cacert:
            self.verify = cacert
        if cert is not None:
            self.cert = cert
        self._user = user
        self._password = password
        self._timeout = timeout
        self._client: Any = None
        self._lock = threading.Lock()
        self._token: str | None = None
        self._generation = 0  # tokens got so far (0: none tried yet); a request remembers the one it sent
        self._auth_off_logged = False

    @property
    def tokens_obtained(self) -> int:
        """How many times this session got a token from etcd (or found its auth off)."""
        return self._generation

    def attach(self, client: Any) -> Any:
        """Tie this session to ``client`` (the etcd3gw client it serves: where to ask for tokens); returns it."""
        self._client = client
        return client

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> Any:
        if self._cacert:  # (requests lets $REQUESTS_CA_BUNDLE override a session's verify, not a request's)
            kwargs.setdefault("verify", self._cacert)
        is_post = (method.decode() if isinstance(method, bytes) else method).upper() == "POST"
        if not self._user or not is_post:  # (GET /version, /health: etcd answers them with no token)
            return super().request(method, url, *args, **kwargs)
        with self._lock:
            generation, token = self._generation, self._token
        if generation == 0:
            generation, token = self._get_token(stale_generation=0)
        response = self._send(method, url, token, args, kwargs)
        if self._token_refused(response):
            response.close()
            _, token = self._get_token(stale_generation=generation)
            response = self._send(method, url, token, args, kwargs)
        return response

    def _send(self, method: Any, url: Any, token: str | None, args: tuple, kwargs: dict[str, Any]) -> Any:
        headers = dict(kwargs.get("headers") or {})
        if token is not None:
            headers["Authorization"] = token
        return super().request(method, url, *args, **{**kwargs, "headers": headers})

    @staticmethod
    def _token_refused(response: Any) -> bool:
        if response.status_code == 401:  # etcd 3.4: {"error": "etcdserver: invalid auth token", "code": 16}
            return True
        return response.status_code == 400 and any(text in response.content for text in _GET_A_TOKEN)

    def _get_token(self, stale_generation: int) -> tuple[int, str | None]:
        """(generation, token): a new token (None where etcd's auth is off), unless another thread got one since
        ``stale_generation``."""
        with self._lock:
            if self._generation != stale_generation:
                return self._generation, self._token
            if self._client is None:
                raise RuntimeError("EtcdSession.attach(client) was not called")
            url = self._client.get_url("/auth/authenticate")
            kwargs: dict[str, Any] = {"verify": self._cacert} if self._cacert else {}
            response = super().request(
                "POST", url, json={"name": self._user, "password": self._password}, timeout=self._timeout, **kwargs
            )
            where = self._client.base_url
            error = _etcd_error(response)
            if response.status_code == 200:
                self._token = response.json().get("token") or None
            elif "authentication is not enabled" in error:  # (requests then go without one: etcd takes those)
                self._token = None
                if not self._auth_off_logged:
                    self._auth_off_logged = True
                    log.warning("etcd at %s has its auth off: user %r is not needed there", where, self._user)
            elif response.status_code == 400 and "authentication failed" in error:
                raise InvalidValue(
                    f"cluster: etcd at {where} refused user {self._user!r}: {error} (the password is ${ENV_PASSWORD})"
                )
            else:  # (etcd itself in trouble, say no leader: as if out of reach, so the next endpoint is tried)
                from etcd3gw import exceptions

                raise exceptions.ConnectionFailedError(
                    f"etcd at {where} gave no token to user {self._user!r}: HTTP {response.status_code} {error}"
                )
            self._generation += 1
            return self._generation, self._token


def _etcd_error(response: Any) -> str:
    """The error etcd's gateway put in ``response``'s body (its text where that is no JSON)."""
    try:
        body = response.json()
        return str(body.get("error") or body.get("message") or body)[:300]
    except Exception:
        return response.text[:300]


def _on(lease: Any, client: Any) -> Any:
    """``lease`` sent through ``client`` (etcd3gw's leases keep the client that granted them; any endpoint of the
    etcd cluster knows them)."""
    lease.client = client
    return lease


class EtcdMembership(Membership):
    """A view of the member list of the kvstrata cluster ``NAME`` in etcd (see the module's docstring).

    ``url``: ``etcd://`` or ``etcds://`` (:func:`parse_etcd_address`); it stays the view's identity (:attr:`url`),
    and holds no secret. Opening checks the certificate files (InvalidValue naming one that is missing), reaches
    etcd (TransportError naming each endpoint and why) and, with a user, gets a token (InvalidValue for wrong
    credentials).
    """

    def __init__(self, url: str, *, timeout: float = 5.0, refresh_s: float = REFRESH_S) -> None:
        try:
            import etcd3gw  # noqa: F401
        except ImportError as exc:  # (an optional dependency: pip install 'kvstrata[cluster]')
            raise ImportError(
                "etcd:// and etcds:// clusters need the etcd3gw package: pip install 'kvstrata[cluster]'"
            ) from exc
        from etcd3gw import exceptions

        self._url = url
        self._address = parse_etcd_address(url)
        self._address.check_files()
        self._password = os.environ.get(ENV_PASSWORD, "")  # (here only: never in the address, nor in a message)
        if self._address.user and not self._password:
            raise InvalidValue(
                f"cluster: user {self._address.user!r} (from {self._address.source('user')}) needs its password "
                f"in ${ENV_PASSWORD}"
            )
        if self._password and not self._address.user:
            raise InvalidValue(f"cluster: ${ENV_PASSWORD} is set but no user: give ?user=NAME or ${ENV_USER}")
        self._endpoints, self.name = list(self._address.endpoints), self._address.name
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
        try:  # (fails here, naming etcd, rather than at the first use; with a user, its token is got here too)
            self._call(lambda client: client.status())
        except BaseException:
            self._close_clients(self._clients)
            raise

    @property
    def url(self) -> str:
        return self._url

    def _new_client(self, host: str, port: int) -> Any:
        import etcd3gw

        address = self._address
        session = EtcdSession(
            cacert=address.cacert,
            cert=(address.cert, address.key) if address.cert else None,
            user=address.user,
            password=self._password,
            timeout=self._timeout,
        )
        protocol = "https" if address.tls else "http"
        return session.attach(
            etcd3gw.client(host=host, port=port, timeout=self._timeout, protocol=protocol, session=session)
        )

    @staticmethod
    def _close_clients(clients: list[Any]) -> None:
        for client in clients:
            with contextlib.suppress(Exception):
                client.session.close()

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
                # (etcd3gw keeps the reason in detail_text: its exceptions' str() is empty)
                errors.append(f"{host}:{port}: {(getattr(exc, 'detail_text', None) or str(exc))[:300]}")
                continue
            if watch is None:
                self._current = i
            else:
                watch.current = i
            return result
        raise TransportError(f"cannot reach etcd for cluster {self._url}: " + "; ".join(errors) + self._hint(errors))

    def _hint(self, errors: list[str]) -> str:
        """What the errors of unreachable endpoints suggest of a scheme or certificate mismatch ("" where nothing)."""
        text = " ".join(errors)
        if not self._address.tls and ("RemoteDisconnected" in text or "Connection aborted" in text):
            return " (an etcd that serves HTTPS needs an etcds:// address)"
        upper = text.upper()
        # (a plain-HTTP etcd answers a TLS hello with a 400 and closes: the client reads that as a bad record, an
        # EOF, or, where the close races the rest of the hello, a reset)
        plain_signs = ("WRONG_VERSION_NUMBER", "EOF OCCURRED", "_EOF_", "CONNECTIONRESETERROR", "CONNECTION RESET")
        if self._address.tls and any(sign in upper for sign in plain_signs):
            return " (it did not answer in TLS: an etcd over plain HTTP needs an etcd:// address)"
        if self._address.tls and "CERTIFICATE_VERIFY_FAILED" in upper:
            return f" (etcd's certificate is not signed by the CA given: ?cacert= or ${ENV_CACERT})"
        if self._address.tls and ("BAD_CERTIFICATE" in upper or "CERTIFICATE_REQUIRED" in upper):
            if not self._address.cert:
                return f" (etcd wants a client certificate: ?cert=&key= or ${ENV_CERT} and ${ENV_KEY})"
            return f" (etcd refused the client certificate {self._address.cert} from {self._address.source('cert')})"
        return ""

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
            self._close_clients(watch.clients)

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
        self._close_clients(self._clients)


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
