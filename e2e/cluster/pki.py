"""Throwaway PKI for a test control plane, made with the openssl CLI.

The openssl CLI is on every Debian/Ubuntu machine and CI image, so the
harness needs no Python crypto package. Keys are EC P-256: generation is
instant, and every component (apiserver, controller manager, client-go)
accepts them, the service-account signing key included.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_CIDR = "10.0.0.0/16"  # room for bench/operator_scale.py --count 1000 (one IP per service)
SERVICE_IP = "10.0.0.1"
"""First address of SERVICE_CIDR: the `kubernetes` Service's ClusterIP."""

_DAYS = "30"


@dataclass(frozen=True)
class CertPair:
    """A PEM certificate and its private key on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Every credential the control plane needs, under one folder."""

    ca: CertPair
    serving: CertPair
    admin: CertPair
    controller_manager: CertPair
    scheduler: CertPair
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, stdin: str | None = None) -> None:
    """Run openssl and surface its stderr, since its failures are otherwise opaque."""
    result = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _new_key(path: Path) -> Path:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )
    path.chmod(0o600)
    return path


def _make_ca(directory: Path) -> CertPair:
    key = _new_key(directory / "ca.key")
    cert = directory / "ca.crt"
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(key),
        "-out",
        str(cert),
        "-days",
        _DAYS,
        "-subj",
        "/CN=tandem-e2e-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )
    return CertPair(cert, key)


def _issue(ca: CertPair, directory: Path, name: str, subject: str, extensions: str) -> CertPair:
    """Sign a leaf certificate; `extensions` is an openssl v3 extension section body."""
    key = _new_key(directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    cert = directory / f"{name}.crt"
    ext.write_text(extensions)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-CAcreateserial",
        "-days",
        _DAYS,
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    csr.unlink()
    ext.unlink()
    return CertPair(cert, key)


def _client(ca: CertPair, directory: Path, name: str, user: str, group: str | None) -> CertPair:
    """Client certificate: CN is the user name, O the group (what RBAC sees)."""
    subject = f"/CN={user}" + (f"/O={group}" if group else "")
    return _issue(
        ca,
        directory,
        name,
        subject,
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=clientAuth\n",
    )


def _serving(ca: CertPair, directory: Path) -> CertPair:
    """API server certificate valid for loopback and the in-cluster service names."""
    names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    san = ",".join([f"DNS:{n}" for n in names] + ["IP:127.0.0.1", f"IP:{SERVICE_IP}"])
    return _issue(
        ca,
        directory,
        "apiserver",
        "/CN=kube-apiserver",
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n",
    )


def generate(directory: Path) -> Pki:
    """Create a fresh CA, serving and client certificates and the service-account key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _make_ca(directory)
    sa_key = _new_key(directory / "sa.key")
    sa_pub = directory / "sa.pub"
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    return Pki(
        ca=ca,
        serving=_serving(ca, directory),
        admin=_client(ca, directory, "admin", "tandem-e2e-admin", "system:masters"),
        controller_manager=_client(
            ca, directory, "controller-manager", "system:kube-controller-manager", None
        ),
        scheduler=_client(ca, directory, "scheduler", "system:kube-scheduler", None),
        sa_key=sa_key,
        sa_pub=sa_pub,
    )
