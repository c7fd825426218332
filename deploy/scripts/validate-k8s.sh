#!/usr/bin/env bash
# Renders deploy/k8s/cluster.toml with `tessera deploy k8s` (fresh host keys, in a
# temporary directory), builds it with kustomize (`kubectl kustomize`) and validates every
# object against the Kubernetes schemas offline (kubernetes-validate, which carries them),
# rejecting unknown fields. With --image, also builds the container image where a
# container engine runs; where none does, it says so and skips that step.
#
# Usage: deploy/scripts/validate-k8s.sh [--image]
# Env: TESSERA (default: cargo run --release --), K8S_VERSION (default 1.31.0),
#      VENV (default: ~/.cache/tessera-k8s-venv, where kubernetes-validate is installed).
set -euo pipefail

case "${1:-}" in
  -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --image|"") ;;
  *) echo "unknown argument: $1 (try --help)" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/../.."
K8S_VERSION="${K8S_VERSION:-1.31.0}"
VENV="${VENV:-$HOME/.cache/tessera-k8s-venv}"
read -r -a tessera <<< "${TESSERA:-cargo run --release --quiet --}"

if ! command -v kubectl > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "kubectl: installing Debian's kubernetes-client" >&2
    apt-get install -y -q kubernetes-client > /dev/null || { apt-get update -q > /dev/null && apt-get install -y -q kubernetes-client > /dev/null; }
  else
    echo "kubectl is missing (it renders the kustomization); install it and run again" >&2
    exit 1
  fi
fi
if [ ! -x "$VENV/bin/kubernetes-validate" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "kubernetes-validate==1.31.0"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"${tessera[@]}" deploy k8s deploy/k8s/cluster.toml --out "$tmp/base" --gen-keys 2> "$tmp/render.log" \
  || { cat "$tmp/render.log" >&2; exit 1; }
kubectl kustomize "$tmp/base" > "$tmp/all.yaml"
"$VENV/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$tmp/all.yaml"
objects=$(grep -c '^kind:' "$tmp/all.yaml")
workloads=$(grep -c '^kind: StatefulSet' "$tmp/all.yaml")
for probe in readinessProbe livenessProbe; do
  have=$(grep -c "$probe:" "$tmp/all.yaml")
  [ "$have" = "$workloads" ] || { echo "$probe: $have of $workloads workloads" >&2; exit 1; }
done
echo "k8s: $objects objects rendered from deploy/k8s/cluster.toml, valid against Kubernetes $K8S_VERSION (strict); every StatefulSet has both probes"

if [ "${1:-}" = "--image" ]; then
  if command -v docker > /dev/null && docker info > /dev/null 2>&1; then
    docker build -t tessera:ci .
    echo "image: tessera:ci built"
  else
    echo "image: SKIPPED: no container engine runs on this machine (docker info fails); the Dockerfile was not built"
  fi
fi
