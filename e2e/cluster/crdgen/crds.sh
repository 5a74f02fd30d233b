#!/usr/bin/env bash
# Generates the CustomResourceDefinitions of KEDA (keda.sh), the Prometheus Operator
# (monitoring.coreos.com) and the Gateway API Inference Extension's InferencePool
# (inference.networking.k8s.io) and LeaderWorkerSet (leaderworkerset.x-k8s.io) from their published Go API types with controller-gen, a tool of
# this module, into the folder given as $1. A module of its own, so its dependencies never
# change the control plane's go.mod (and its binaries' cache key).
set -euo pipefail

out=${1:?usage: crds.sh OUT_DIR}
cd "$(dirname "$0")"
mkdir -p "$out"
nice -n "${TANDEM_E2E_NICE:-10}" go tool controller-gen \
  crd:allowDangerousTypes=true,maxDescLen=0 \
  paths=github.com/kedacore/keda/v2/apis/keda/v1alpha1 \
  paths=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1 \
  paths=sigs.k8s.io/gateway-api-inference-extension/api/v1 \
  output:crd:dir="$out"
# LWS with generateEmbeddedObjectMeta, as its own Makefile generates it: without it the API
# server prunes the labels and annotations of its pod templates (metadata: {type: object}).
nice -n "${TANDEM_E2E_NICE:-10}" go tool controller-gen \
  crd:allowDangerousTypes=true,maxDescLen=0,generateEmbeddedObjectMeta=true \
  paths=sigs.k8s.io/lws/api/leaderworkerset/v1 \
  output:crd:dir="$out"
