"""The operator-wide render settings (from the Helm values and the operator's own state)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGE = "ghcr.io/tandem-dev/tandem:0.1.0"


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings (from Helm values), not per InferenceService."""

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    model_ready: bool = True
    """False while an hf:// download Job has not succeeded: engines are not rendered yet."""
    model_cached: bool = False
    """The cache claim already holds the model (a retained cache): no download Job."""
    gang_scheduling: bool = False
    """Admit a Disaggregated service's engines as a gang (Kubernetes' PodGroup API)."""
    hold_old_layout: bool = False
    """A KV-layout change is under way and no new-layout pair is Ready yet: keep the old
    engines (``rollout.hold_old_layout``)."""
    admission_gates: bool = False
    """Create GPU engine pods with a schedulingGate that the operator's gang admission
    removes once the whole service fits (``admission.py``); the operator turns it on unless
    the PodGroup API does the same (``gang_scheduling``)."""
