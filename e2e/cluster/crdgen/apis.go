//go:build tools

// Package crdgen pins the published Go API types whose CRDs the e2e cluster installs:
// KEDA's ScaledObject, the Prometheus Operator's PodMonitor/ServiceMonitor and the Gateway
// API Inference Extension's InferencePool, and LeaderWorkerSet (sigs.k8s.io/lws: an engine
// replica that spans nodes).
// controller-gen (a tool of this module) generates the CRDs from them.
package crdgen

import (
	_ "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	_ "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	_ "sigs.k8s.io/lws/api/leaderworkerset/v1"
)
