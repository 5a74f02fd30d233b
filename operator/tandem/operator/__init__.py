"""Tandem's Kubernetes operator (import as ``tandem.operator``, never as top-level ``operator``)."""
