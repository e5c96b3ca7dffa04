"""etcd reached securely: ``etcds://`` (TLS, with a client certificate where etcd wants one) and etcd's user/password
auth, each with a worker joining and a cluster client using it; a token etcd dropped got again unseen; bad input
(missing files, a cert without its key, unknown or misplaced parameters, a wrong password, HTTP against HTTPS)
refused by name, at once, and never showing the password. Each test module's etcds are its own (LocalEtcd), with
a throwaway CA made by the ``openssl`` CLI."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw", reason="the etcd backend's tests need etcd3gw (pip install 'kvstrata[cluster]')")
import requests

import kvstrata
from kv_helpers import wait_until
from kvstrata.bench._etcd import LocalEtcd
from kvstrata.cluster import open_membership
from kvstrata.cluster.etcd import ENV_CACERT, ENV_CERT, ENV_KEY, ENV_PASSWORD, ENV_USER, parse_etcd_address
from kvstrata.errors import InvalidValue, TransportError
from kvstrata.server import WorkerConfig

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")

PASSWORD = "s3cret-Pa55word"  # (the kv user's; the tests check that no message or address shows it)
ROOT_PASSWORD = "r00t-Pa55word"


@pytest.fixture(autouse=True)
def no_etcd_settings_from_outside(monkeypatch):
    """The tests set what they mean to; nothing from the environment they run in."""
    for name in (ENV_CACERT, ENV_CERT, ENV_KEY, ENV_USER, ENV_PASSWORD):
        monkeypatch.delenv(name, raising=False)


def make_certs(folder: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and localhost (server and client use: etcd's gateway
    presents it to etcd) and a client certificate, with the ``openssl`` CLI: their paths by name."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # (EC: made in milliseconds)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvstrata test CA")
    for name, usage, san in (
        ("server", "serverAuth,clientAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
        ("client", "clientAuth", ""),
    ):
        (folder / f"{name}.ext").write_text(f"{san}extendedKeyUsage={usage}\n")
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvstrata-{name}")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    names = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    return {name: str(folder / name) for name in names}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mtls_etcd(certs):
    """An etcd over HTTPS that takes only clients with a certificate of the test CA."""
    with LocalEtcd(tls=(certs["ca.pem"], certs["server.pem"], certs["server.key"])) as etcd:
        yield etcd


def _gateway(etcd: LocalEtcd, ca: str, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Authorization": token} if token else {}
    reply = requests.post(f"https://{etcd.endpoint}/v3/{path}", json=body, headers=headers, verify=ca, timeout=5)
    assert reply.status_code == 200, f"{path}: {reply.status_code} {reply.text}"
    return reply.json()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def auth_etcd(certs):
    """An etcd over HTTPS (its certificate checked, none asked of clients) with auth on: root, and user ``kv`` whose
    role may read and write /kvstrata/ only. Simple tokens that lapse after 1 s unused, so the tests see them go."""
    ca = certs["ca.pem"]
    with LocalEtcd(
        tls=(ca, certs["server.pem"], certs["server.key"]),
        client_cert_auth=False,
        args=["--auth-token", "simple", "--auth-token-ttl", "1"],
    ) as etcd:
        _gateway(etcd, ca, "auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        _gateway(etcd, ca, "auth/user/grant", {"user": "root", "role": "root"})
        _gateway(etcd, ca, "auth/role/add", {"name": "kvstrata"})
        permission = {"permType": "READWRITE", "key": _b64("/kvstrata/"), "range_end": _b64("/kvstrata0")}
        _gateway(etcd, ca, "auth/role/grant", {"name": "kvstrata", "perm": permission})
        _gateway(etcd, ca, "auth/user/add", {"name": "kv", "password": PASSWORD})
        _gateway(etcd, ca, "auth/user/grant", {"user": "kv", "role": "kvstrata"})
        _gateway(etcd, ca, "auth/enable", {})
        yield etcd


def _name() -> str:
    return f"s{uuid.uuid4().hex[:12]}"


def _use_the_cluster(url: str, workers_at) -> list:
    """A worker joins ``url``; a cluster client sees it and sets and gets a key through it. The workers."""
    started = workers_at(url).start(1)
    with kvstrata.connect(cluster=url, timeout=10) as kv:
        assert wait_until(lambda: len(kv.nodes) == 1, 10), kv.nodes
        kv.set("secure/key", b"over TLS")
        assert kv.get("secure/key") == b"over TLS"
    return started


# TLS ------------------------------------------------------------------------------------------------------------
def test_a_worker_joins_over_tls_with_a_client_certificate_and_a_client_uses_it(mtls_etcd, certs, workers_at):
    query = f"cacert={certs['ca.pem']}&cert={certs['client.pem']}&key={certs['client.key']}"
    url = f"etcds://{mtls_etcd.endpoint}/{_name()}?{query}"
    (worker,) = _use_the_cluster(url, workers_at)
    assert worker.membership.url == url  # (the address stays the view's identity)
    with open_membership(url) as view:
        assert set(view.members()) == {worker.member.node_id}


def test_tls_files_come_from_the_environment_where_the_address_has_none(mtls_etcd, certs, workers_at, monkeypatch):
    monkeypatch.setenv(ENV_CACERT, certs["ca.pem"])
    monkeypatch.setenv(ENV_CERT, certs["client.pem"])
    monkeypatch.setenv(ENV_KEY, certs["client.key"])
    url = f"etcds://{mtls_etcd.endpoint}/{_name()}"
    _use_the_cluster(url, workers_at)


def test_without_a_client_certificate_or_the_ca_etcd_is_not_reached(mtls_etcd, certs):
    started = time.monotonic()
    with pytest.raises(TransportError, match="client certificate"):
        open_membership(f"etcds://{mtls_etcd.endpoint}/x?cacert={certs['ca.pem']}", timeout=3)
    query = f"cert={certs['client.pem']}&key={certs['client.key']}"  # (etcd's certificate checked by the system CAs)
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        open_membership(f"etcds://{mtls_etcd.endpoint}/x?{query}", timeout=3)
    assert time.monotonic() - started < 10


def test_http_against_https_and_https_against_http_fail_clearly_and_at_once(mtls_etcd, etcd_endpoint, certs):
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"cannot reach etcd .*serves HTTPS needs an etcds:// address"):
        open_membership(f"etcd://{mtls_etcd.endpoint}/x", timeout=3)
    with pytest.raises(TransportError, match=r"cannot reach etcd .*did not answer in TLS: .* needs an etcd:// address"):
        open_membership(f"etcds://{etcd_endpoint}/x?cacert={certs['ca.pem']}", timeout=3)
    assert time.monotonic() - started < 10


def test_each_way_a_plain_etcd_turns_a_tls_hello_away_is_read_as_the_scheme_mismatch():
    # (which of these a client sees depends on how etcd's close races the hello: CI once saw the reset)
    from types import SimpleNamespace

    from kvstrata.cluster.etcd import EtcdMembership

    view = SimpleNamespace(_address=parse_etcd_address("etcds://127.0.0.1:1/x"))
    for seen in (
        "[SSL: WRONG_VERSION_NUMBER] wrong version number",
        "EOF occurred in violation of protocol",
        "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
    ):
        assert "needs an etcd:// address" in EtcdMembership._hint(view, [f"127.0.0.1:1: {seen}"])
    assert EtcdMembership._hint(view, ["127.0.0.1:1: Connection refused"]) == ""


def test_bad_tls_settings_are_refused_by_name_when_the_view_opens(certs, tmp_path, monkeypatch):
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(InvalidValue, match=rf"cacert file '{missing}' \(from \?cacert=\) does not exist"):
        open_membership(f"etcds://127.0.0.1:1/x?cacert={missing}")
    with pytest.raises(InvalidValue, match=r"key file .* does not exist"):
        open_membership(f"etcds://127.0.0.1:1/x?cert={certs['client.pem']}&key={missing}")
    with pytest.raises(InvalidValue, match=r"needs both cert and key: cert is given \(\?cert=\), key is not"):
        open_membership(f"etcds://127.0.0.1:1/x?cert={certs['client.pem']}")
    with pytest.raises(InvalidValue, match=r"unknown parameters 'bogus', 'verify' .*known: cacert, cert, key, user"):
        open_membership(f"etcds://127.0.0.1:1/x?cacert={certs['ca.pem']}&bogus=1&verify=no")
    with pytest.raises(InvalidValue, match=r"cacert \(TLS\) in .* etcd:// address .* write etcds://"):
        open_membership(f"etcd://127.0.0.1:1/x?cacert={certs['ca.pem']}")
    with pytest.raises(InvalidValue, match="given twice"):
        open_membership(f"etcds://127.0.0.1:1/x?cacert={certs['ca.pem']}&cacert={certs['ca.pem']}")
    monkeypatch.setenv(ENV_KEY, missing)  # (from the environment: named so)
    with pytest.raises(InvalidValue, match=rf"key file .* \(from \${ENV_KEY}\) does not exist"):
        open_membership(f"etcds://127.0.0.1:1/x?cert={certs['client.pem']}")
    monkeypatch.setenv(ENV_CACERT, missing)  # (the TLS files of the environment are for etcds:// only)
    assert parse_etcd_address("etcd://127.0.0.1:1/x").cacert == ""


def test_the_worker_settings_take_etcds():
    config = WorkerConfig(socket="/tmp/x.sock", memory=16 << 20, disk_dir="", cluster="etcds://10.0.0.1:2379/kv")
    assert config.cluster == "etcds://10.0.0.1:2379/kv"
    with pytest.raises(InvalidValue, match="etcds://"):
        WorkerConfig(socket="/tmp/x.sock", memory=16 << 20, disk_dir="", cluster="https://10.0.0.1:2379/kv")


# user and password ----------------------------------------------------------------------------------------------
def test_a_worker_joins_with_a_user_and_password_and_lost_tokens_are_got_again(
    auth_etcd, certs, workers_at, monkeypatch
):
    """Tokens etcd dropped (auth turned off, then on again, by root; simple tokens lapsing after 1 s unused) are got
    again without a word, by the callers' threads and the watch threads alike: the worker stays listed under its
    lease, and a client keeps reading the list and reading and writing keys."""
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)
    url = f"etcds://{auth_etcd.endpoint}/{_name()}?cacert={certs['ca.pem']}&user=kv"
    (worker,) = _use_the_cluster(url, workers_at)
    membership = worker.membership
    assert PASSWORD not in membership.url and PASSWORD not in repr(membership)
    lease, node = membership._lease, worker.member.node_id
    ca = certs["ca.pem"]
    with kvstrata.connect(cluster=url, timeout=10) as kv:
        assert wait_until(lambda: len(kv.nodes) == 1, 10)
        session = membership._clients[0].session
        watching = kv.membership._watches[0].clients[0].session
        got = session.tokens_obtained, watching.tokens_obtained
        root = _gateway(auth_etcd, ca, "auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})
        _gateway(auth_etcd, ca, "auth/disable", {}, token=root["token"])  # (etcd forgets every token)
        assert set(membership.members()) == {node}  # (its token refused: auth is off, so it goes on without one)
        assert session.tokens_obtained == got[0] + 1
        _gateway(auth_etcd, ca, "auth/enable", {})  # (auth off: anyone may turn it on)
        assert set(membership.members()) == {node}  # (no token: "user name is empty", so it gets one)
        assert session.tokens_obtained == got[0] + 2
        # the client's watch thread re-reads the list at least every 2 s: its token lapsed meanwhile, or went with
        # auth turned off, and it gets another
        assert wait_until(lambda: watching.tokens_obtained > got[1], 10), watching.tokens_obtained
        kv.set("after/revoke", b"still here")
        assert kv.get("after/revoke") == b"still here"
        assert set(kv.membership.members()) == {node}
    with open_membership(url) as view:
        reader = view._clients[0].session
        assert reader.tokens_obtained == 1
        time.sleep(2.5)  # (the view's token lapses unused)
        assert set(view.members()) == {node}
        assert reader.tokens_obtained == 2
    assert membership._lease is lease  # (its lease renewed all along: it never lapsed, nor was listed again)


def test_a_wrong_password_is_refused_at_once_naming_the_user_not_the_password(auth_etcd, certs, monkeypatch):
    url = f"etcds://{auth_etcd.endpoint}/{_name()}?cacert={certs['ca.pem']}&user=kv"
    wrong = "not-" + PASSWORD
    monkeypatch.setenv(ENV_PASSWORD, wrong)
    started = time.monotonic()
    with pytest.raises(InvalidValue, match=r"refused user 'kv': .*authentication failed") as refused:
        open_membership(url, timeout=3)
    assert time.monotonic() - started < 5
    assert wrong not in str(refused.value) and PASSWORD not in str(refused.value)
    monkeypatch.delenv(ENV_PASSWORD)
    with pytest.raises(InvalidValue, match=rf"user 'kv' \(from \?user=\) needs its password in \${ENV_PASSWORD}"):
        open_membership(url)
    monkeypatch.setenv(ENV_PASSWORD, PASSWORD)  # (the user from the environment too)
    monkeypatch.setenv(ENV_USER, "kv")
    with open_membership(f"etcds://{auth_etcd.endpoint}/{_name()}?cacert={certs['ca.pem']}") as view:
        assert view.members() == {}
    monkeypatch.delenv(ENV_USER)
    with pytest.raises(InvalidValue, match="is set but no user"):
        open_membership(f"etcds://{auth_etcd.endpoint}/x?cacert={certs['ca.pem']}")


def test_a_password_is_never_taken_from_the_address():
    for url in ("etcds://127.0.0.1:1/x?user=kv&password=hunter2", "etcds://kv:hunter2@127.0.0.1:1/x"):
        with pytest.raises(InvalidValue, match=ENV_PASSWORD) as refused:
            open_membership(url)
        assert "hunter2" not in str(refused.value)
    assert not os.environ.get(ENV_PASSWORD)
