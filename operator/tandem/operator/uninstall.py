"""``helm uninstall``'s guard: the chart's pre-delete hook runs ``tandem operator
--check-uninstall``, which refuses (exits 1, naming them) while InferenceServices exist.

Uninstalling the operator first would strand them: each carries kopf's finalizer
(``kopf.tandem.dev/finalizer``, for its resync daemon), which only a running operator
removes, so deleting them afterwards hangs and their namespaces stay Terminating. The
order that works: delete the InferenceServices (the operator releases each), then
uninstall. ``helm uninstall --no-hooks`` skips the guard on purpose.
"""

from __future__ import annotations

import sys

from .kube import Kube
from .spec.inference_service import API_VERSION, KIND


def remaining(kube: Kube, namespaces: tuple[str, ...]) -> list[str]:
    """``namespace/name`` of every InferenceService in the watched namespaces (all if none)."""
    found = []
    for namespace in namespaces or ("",):
        for item in kube.list(API_VERSION, KIND, namespace, "", ok_missing=True):
            meta = item["metadata"]
            found.append(f"{meta['namespace']}/{meta['name']}")
    return sorted(found)


def check_uninstall(kube: Kube, namespaces: tuple[str, ...]) -> int:
    """0 when nothing would be stranded; else 1, with what to delete first on stderr."""
    left = remaining(kube, namespaces)
    if not left:
        print("no InferenceServices left: the operator can be uninstalled")
        return 0
    shown = ", ".join(left[:20]) + (f" and {len(left) - 20} more" if len(left) > 20 else "")
    print(
        f"refusing to uninstall the operator: {len(left)} InferenceService(s) still exist "
        f"({shown}); their finalizer needs the running operator. Delete them first "
        "(kubectl delete tisvc --all -A), then uninstall.",
        file=sys.stderr,
    )
    return 1
