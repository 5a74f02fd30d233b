//go:build tools

// Package crdgen pins the published Go API types whose CRDs the e2e cluster installs:
// KEDA's ScaledObject and the Prometheus Operator's PodMonitor/ServiceMonitor.
// controller-gen (a tool of this module) generates the CRDs from them.
package crdgen

import (
	_ "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)
