"""End-to-end tests for Tandem against a real Kubernetes control plane."""
