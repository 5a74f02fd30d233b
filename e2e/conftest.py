"""pytest fixtures: one real control plane per session, one namespace per test.

The e2e tests are skipped, with the reason, when the binaries are not built,
unless TANDEM_E2E_REQUIRE is set (CI sets it): there a missing build must
fail the run rather than pass it silently.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import Cluster, bin_dir, missing_binaries, wait_for
from e2e.cluster.paths import THIRD_PARTY_CRDS, crd_dir, missing_crds
from e2e.utils import PEERING, RELEASE, RELEASE_NS, ROOT, Operator, running_operator


def _binaries() -> Path:
    """TANDEM_E2E_BIN overrides the cache folder (e.g. binaries built elsewhere)."""
    configured = os.environ.get("TANDEM_E2E_BIN")
    return Path(configured) if configured else bin_dir()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A started control plane with fake GPU nodes; stopped at session end, pass or fail."""
    directory = _binaries()
    missing = missing_binaries(directory)
    if missing:
        reason = (
            f"e2e binaries missing in {directory}: {', '.join(missing)} (run: bash e2e/setup.sh)"
        )
        if os.environ.get("TANDEM_E2E_REQUIRE"):
            pytest.fail(reason + "; TANDEM_E2E_REQUIRE is set", pytrace=False)
        pytest.skip(reason)
    instance = Cluster(tmp_path_factory.mktemp("cluster"), directory)
    try:
        instance.start()
        print(
            f"\n[e2e] control plane ready in {instance.startup_seconds:.1f}s "
            f"(state {instance.state_dir})",
            file=sys.stderr,
        )
        yield instance
    finally:
        instance.stop()
        _report_memory(instance)


def _report_memory(instance: Cluster) -> None:
    """Print the components' peak RSS, the figure e2e/README.md quotes."""
    report = instance.state_dir / "memory.json"
    if report.exists():
        data = json.loads(report.read_text())
        print(f"\n[e2e] sum of peak RSS: {data['sum_peak_rss_mib']} MiB", file=sys.stderr)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace whose `default` ServiceAccount exists (pods need it)."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        f"ServiceAccount {name}/default",
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        timeout=60,
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# ---- the chart and the operator ---------------------------------------------------------------


@pytest.fixture(scope="module")
def chart(cluster: Cluster) -> Iterator[None]:
    cluster.helm(
        "install",
        RELEASE,
        str(ROOT / "helm/tandem"),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "--set",
        f"peering.name={PEERING}",
        "--set",
        "image.tag=e2e",
        "--wait",
        "--timeout",
        "120s",
    )
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferenceservices.tandem.dev",
        "crd/clusterkopfpeerings.kopf.dev",
        "--timeout=60s",
    )
    yield
    cluster.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "60s", check=False)


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, chart: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    yield from running_operator(Operator(cluster, tmp_path_factory.mktemp("operator")))


@pytest.fixture(scope="session")
def third_party_crds(cluster: Cluster) -> Iterator[None]:
    """KEDA's, the Prometheus Operator's, GIE's InferencePool and LWS's LeaderWorkerSet CRDs,
    installed once (before any chart install); tests that need them use this fixture."""
    directory = crd_dir()
    missing = missing_crds(directory)
    if missing:
        reason = f"generated CRDs missing in {directory}: {missing} (run: bash e2e/setup.sh)"
        if os.environ.get("TANDEM_E2E_REQUIRE"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    for name in THIRD_PARTY_CRDS:
        cluster.kubectl("apply", "--server-side", "-f", str(directory / name))
    established = (
        "wait",
        "--for=condition=Established",
        "crd/scaledobjects.keda.sh",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/inferencepools.inference.networking.k8s.io",
        "crd/leaderworkersets.leaderworkerset.x-k8s.io",
        "--timeout=60s",
    )
    # kubectl wait fails at once ("status.conditions accessor error") on a CRD created so
    # recently that it has no conditions yet, instead of waiting: ask again until it holds
    wait_for(
        "the third-party CRDs to be Established",
        lambda: cluster.kubectl(*established, check=False).returncode == 0,
        timeout=90,
        interval=1,
    )
    yield
