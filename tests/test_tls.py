"""A service started with Dask TLS (certificates generated at start into the root) runs a tenant end to
end through the gateway; a Dask client without the service's certificate is refused."""

from __future__ import annotations

import os
import socket
import ssl
import stat

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.features import Observation
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    with Nexus.local(tmp_path_factory.mktemp("tls"), n_sim=1, tls=True) as nexus:
        yield nexus


def test_tls_service_runs_a_tenant_end_to_end(nx):
    svc = nx.service
    assert svc.address.startswith("tls://")
    for f in ("ca.pem", "ca.key", "service.pem", "service.key"):
        assert stat.S_IMODE(os.stat(svc.config.tls_dir / f).st_mode) == 0o600
    t = nx.create_tenant(TenantSpec(name="tls-rl", env="maniskill/pushcube-state", seed=21))
    res = t.rl(updates=1, episodes_per_batch=1, collectors=1).result(timeout=600)
    assert res["updates"] == 1 and res["version"] == 1
    report = t.evaluate(episodes=1).result(timeout=600)
    assert report["version"] == 1 and report["episodes"] == 1
    out = t.predict_action(Observation(state=np.zeros(35, np.float32))).result(60)
    assert out["action"].shape == (4,) and out["version"] == 1
    # the scheduler plugin's own client, workers and the gateway all hold the certificate
    assert all(w["address"].startswith("tls://") for w in nx.status()["workers"])
    outside = [x for x in svc.listening() if x[2] not in ("127.0.0.1", "::1")]
    assert not outside, outside


def test_dask_without_the_certificate_is_refused(nx):
    from distributed import Client, Security

    address = nx.service.address
    with pytest.raises((OSError, TimeoutError)):  # plain TCP to a TLS listener
        Client(address.replace("tls://", "tcp://"), timeout=5, set_as_default=False)
    with pytest.raises((OSError, TimeoutError, ValueError)):  # TLS, but with a certificate of another CA
        Client(address, timeout=5, set_as_default=False, security=Security.temporary())
    # TLS that trusts the service's CA but shows no client certificate: the scheduler ends the handshake
    host, port = address.removeprefix("tls://").rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(nx.service.config.tls_dir / "ca.pem"))
    ctx.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw) as tls:
                tls.sendall(b"\0" * 8)
                if tls.recv(1) == b"":  # closed without a word: refused too
                    raise ConnectionError("closed by the scheduler")


def test_restart_keeps_certificates_and_tokens_and_the_owner_resumes(nx):
    """Same root, new processes: the CA and tokens persist; only the tenant's token re-creates it."""
    from nexus.deploy.local import LocalService
    from nexus.errors import Conflict

    cert = (nx.service.config.tls_dir / "service.pem").read_bytes()
    t = nx.tenant("tls-rl")
    token, spec = t.token, TenantSpec(name="tls-rl", env="maniskill/pushcube-state", seed=21)
    old_operator = nx.service.operator_token
    config = nx.service.config
    nx.service.stop()
    svc = LocalService(config, n_sim=1).start()
    try:
        assert (config.tls_dir / "service.pem").read_bytes() == cert
        assert svc.operator_token != old_operator
        with Nexus(svc.gateway_url, token=svc.operator_token) as op:
            op._wait_for_workers(svc.n_workers, timeout=180)
        with Nexus(svc.gateway_url) as stranger, pytest.raises(Conflict, match="needs its token"):
            stranger.create_tenant(spec)
        with Nexus(svc.gateway_url, token=token) as owner:
            again = owner.create_tenant(spec)
            assert again.info["version"] == 1 and again.info["token"] is None  # resumed, no new token
            assert again.evaluate(episodes=1).result(timeout=600)["version"] == 1
    finally:
        svc.stop()
