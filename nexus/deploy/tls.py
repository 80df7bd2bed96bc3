"""Dask over mutual TLS: a private CA and one service certificate, generated at service start.

Dask access is code execution (a client may run any pickled function on every worker), so with
``ServiceConfig.tls`` every Dask connection — scheduler, workers, nannies, the plugin's and the
gateway's clients — needs a certificate signed by the service's own CA (``distributed.Security``
verifies both sides). The CA and the certificate live in ``root/tls/`` (dir 0700, keys 0600); only
the service's own processes read them. Tenants never hold them: they talk to the gateway.

A gateway on a non-loopback address serves HTTPS with a certificate of its own, issued by the same CA
for the names clients reach it by (:func:`server_certificate`); clients verify it with ``root/tls/ca.pem``
(public: it may be handed to tenants).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexus.config.paths import private_write_bytes


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path

    def cli_args(self) -> list[str]:
        """``dask scheduler`` / ``dask worker`` options."""
        return ["--tls-ca-file", str(self.ca), "--tls-cert", str(self.cert), "--tls-key", str(self.key)]


def tls_files(directory: str | Path) -> TLSFiles:
    d = Path(directory)
    return TLSFiles(ca=d / "ca.pem", cert=d / "service.pem", key=d / "service.key")


def ensure_certificates(directory: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                        days: int = 365) -> TLSFiles:
    """Create the CA and the service certificate once (kept across restarts of the same root)."""
    files = tls_files(directory)
    if files.ca.exists() and files.cert.exists() and files.key.exists():
        return files
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "JoyNexus service CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key, cert = _issue(ca, ca_key, "joynexus-service", hosts, days, client=True)
    private_write_bytes(Path(directory) / "ca.key", pem_key(ca_key))
    private_write_bytes(files.key, pem_key(key))
    private_write_bytes(files.cert, cert)
    private_write_bytes(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    return files


def _issue(ca: Any, ca_key: Any, common_name: str, hosts: tuple[str, ...], days: int,
           client: bool) -> tuple[Any, bytes]:
    """A key and a PEM certificate for ``hosts`` (IP addresses or DNS names) signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert.public_bytes(serialization.Encoding.PEM)


def server_certificate(directory: str | Path, name: str, hosts: tuple[str, ...], days: int = 365) -> tuple[Path, Path]:
    """(certificate, key) of an HTTPS server for ``hosts``, issued by the service CA of ``directory`` (created by
    :func:`ensure_certificates`); written as ``NAME.pem`` / ``NAME.key``, replaced at every call so the names
    follow the server's current addresses."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    d = Path(directory)
    try:
        ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no service CA in {d} ({e.filename}): the scheduler creates it "
                                "(`nexus scheduler` with TLS)") from None
    key, cert = _issue(ca, ca_key, f"joynexus-{name}", hosts, days, client=False)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    private_write_bytes(d / f"{name}.key", key_pem)
    private_write_bytes(d / f"{name}.pem", cert)
    return d / f"{name}.pem", d / f"{name}.key"


def security(config: Any) -> Any:
    """The ``distributed.Security`` of a service process (every role), or None without TLS."""
    if not getattr(config, "tls", False):
        return None
    from distributed import Security

    f = tls_files(config.tls_dir)
    paths = {"tls_ca_file": str(f.ca), "tls_client_cert": str(f.cert), "tls_client_key": str(f.key),
             "tls_scheduler_cert": str(f.cert), "tls_scheduler_key": str(f.key),
             "tls_worker_cert": str(f.cert), "tls_worker_key": str(f.key)}
    return Security(require_encryption=True, **paths)
