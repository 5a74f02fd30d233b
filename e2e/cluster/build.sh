#!/usr/bin/env bash
# Compiles etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
# kwok from this Go module into the folder given as $1.
#
# One `go build` for all five main packages, so the packages they share
# (client-go, apimachinery, grpc, etcd client, ...) compile once. Static,
# stripped, path-independent binaries keep the cold build short and the cache
# relocatable. The -X flags make the servers report their real version (a
# module build otherwise reports v0.0.0-master).
set -euo pipefail

out=${1:?usage: build.sh OUT_DIR}
cd "$(dirname "$0")"

kube_version=$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' go.mod)
major=${kube_version#v}; major=${major%%.*}
minor=${kube_version#v*.}; minor=${minor%%.*}
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$kube_version"
  ldflags+=" -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
  ldflags+=" -X $pkg.buildDate=$build_date"
done

jobs=${TANDEM_E2E_BUILD_JOBS:-$(nproc)}
mkdir -p "$out"
CGO_ENABLED=0 nice -n "${TANDEM_E2E_NICE:-10}" \
  go build -p "$jobs" -trimpath -ldflags "$ldflags" -o "$out/" ./cmd/...
