"""``tandem operator``: run the operator in a cluster (ServiceAccount) or outside (kubeconfig).

Also ``tandem operator --render FILE``: print the manifests an InferenceService YAML becomes,
without a cluster, which is how to see what the operator would do.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .render.options import DEFAULT_IMAGE, RenderOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What the operator watches and the pods it renders; then how it runs."""
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig for running outside a cluster (default: in-cluster, else $KUBECONFIG)",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=None,
        dest="namespaces",
        help="watch only this namespace (repeatable; default: $TANDEM_WATCH_NAMESPACES "
        "comma-separated, else all namespaces)",
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("TANDEM_IMAGE", DEFAULT_IMAGE),
        help="image for engines and proxies when spec.engine.image is unset (default: $TANDEM_IMAGE)",
    )
    parser.add_argument(
        "--image-pull-policy",
        default=os.environ.get("TANDEM_IMAGE_PULL_POLICY", "IfNotPresent"),
        choices=("Always", "IfNotPresent", "Never"),
        help="the pull policy of the pods the operator creates ($TANDEM_IMAGE_PULL_POLICY)",
    )
    parser.add_argument(
        "--gang-scheduling",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("TANDEM_GANG_SCHEDULING", "") == "true",
        help="admit each Disaggregated service's prefill and decode pods together (Kubernetes' "
        "PodGroup API: feature gates GenericWorkload and GangScheduling, "
        "scheduling.k8s.io/v1alpha2 enabled; default: $TANDEM_GANG_SCHEDULING)",
    )
    parser.add_argument(
        "--admission-gates",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("TANDEM_ADMISSION_GATES", "true") != "false",
        help="create GPU engine pods with a schedulingGate and remove it only when the whole "
        "service fits the free GPUs (GA since Kubernetes 1.30; default on; --gang-scheduling, "
        "the PodGroup API, replaces it)",
    )
    _runtime_arguments(parser)


def _runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """How the operator runs: leader election, resync, the planner loop, liveness, logs."""
    parser.add_argument(
        "--peering",
        default=os.environ.get("TANDEM_PEERING") or None,
        help="kopf peering name for leader election among operator replicas "
        "(default: $TANDEM_PEERING; unset runs standalone)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=120.0,
        help="re-apply every InferenceService's children this often (level-based healing)",
    )
    parser.add_argument(
        "--planner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the Planner backend's loop every 15 s (--no-planner: leave it to a driver "
        "such as bench/autoscale.py --cluster)",
    )
    parser.add_argument(
        "--metrics-address",
        default="",
        help="serve the operator's own metrics (controller_runtime_reconcile_total, ...) at "
        "host:port, e.g. 0.0.0.0:8081 (port 0: any free port, logged); '' serves none",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint ('' disables)",
    )
    parser.add_argument(
        "--render",
        metavar="FILE",
        default=None,
        help="print the manifests for an InferenceService YAML ('-' for stdin) and exit",
    )
    parser.add_argument(
        "--check-uninstall",
        action="store_true",
        help="exit 1 while InferenceServices exist (the chart's pre-delete hook), else 0",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the least severe log records written",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        logging.getLogger("kopf").setLevel(logging.WARNING)  # one line per handled event is noise
    options = RenderOptions(
        image=args.image,
        image_pull_policy=args.image_pull_policy,
        gang_scheduling=args.gang_scheduling,
        admission_gates=args.admission_gates and not args.gang_scheduling,
    )
    if args.render:
        return _render(args.render, options)

    import kopf

    from .handlers import operator_memo  # importing it registers kopf's handlers
    from .kube import load_config
    from .state import OperatorOptions

    load_config(args.kubeconfig)  # sets the default client configuration that kopf's login uses
    namespaces = args.namespaces or [
        n for n in os.environ.get("TANDEM_WATCH_NAMESPACES", "").split(",") if n
    ]
    if args.check_uninstall:
        from .kube import Kube, client
        from .uninstall import check_uninstall

        return check_uninstall(Kube(client.ApiClient()), tuple(namespaces))
    memo = operator_memo(
        OperatorOptions(
            render=options,
            resync_seconds=args.resync_seconds,
            peering=args.peering,
            namespaces=tuple(namespaces),
            planner=args.planner,
            metrics_address=args.metrics_address,
        )
    )
    kopf.run(
        memo=memo,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=not args.peering,
        peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
    )
    return 0


def _render(path: str, options: RenderOptions) -> int:
    """Every InferenceService in the file (a multi-document file's other objects, a
    ConfigMap beside it say, are the user's own and pass through unrendered)."""
    import yaml

    from .render.manifests import render
    from .spec.inference_service import load_inference_service

    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        services = [load_inference_service(d) for d in docs if _is_inference_service(d)]
    except (ValueError, yaml.YAMLError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if not services:
        print(f"{path}: no InferenceService in it", file=sys.stderr)
        return 2
    manifests = [m for isvc in services for m in render(isvc, options)]
    sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
    return 0


def _is_inference_service(doc: object) -> bool:
    return not isinstance(doc, dict) or doc.get("kind", "InferenceService") == "InferenceService"
