"""Real Kubernetes control plane (etcd, apiserver, controller manager, scheduler, kwok) for e2e tests.

Binaries come from e2e/setup.sh (built from Go modules, cached by version);
:class:`Cluster` runs them on loopback. See e2e/README.md.
"""

from e2e.cluster.harness import Cluster, ClusterError, NodeShape, wait_for
from e2e.cluster.paths import bin_dir, missing_binaries, read_versions

__all__ = [
    "Cluster",
    "ClusterError",
    "NodeShape",
    "bin_dir",
    "missing_binaries",
    "read_versions",
    "wait_for",
]
