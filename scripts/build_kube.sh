#!/usr/bin/env bash
# Build a real Kubernetes control plane (kube-apiserver and kube-controller-manager v1.20.2) offline
# from Debian bookworm's source package, for the operator's real-control-plane tests
# (tests/realk8s.py). ../shared/REALK8S.md tells how this was found to work.
#
#   scripts/build_kube.sh            build if needed; print the folder holding the binaries
#
# The folder is ~/.cache/specdecode/kube-<first 12 hex of this script's sha256>/ ($XDG_CACHE_HOME
# if set): changing this script builds anew. It follows envtest's layout (etcd, kube-apiserver,
# kubectl) plus kube-controller-manager; etcd and kubectl are links to Debian's etcd-server and
# kubernetes-client (or the kubectl the machine has). A cold build takes about 8 minutes of two
# cores and 3 GB of disk under $TMPDIR, all deleted afterwards; the binaries take ~210 MB. Debian
# packages it needs are installed when missing (as root); the source comes through a private
# sources list, never touching the system's apt config.
set -euo pipefail

KUBE_VERSION=v1.20.2
SOURCE_PACKAGE=kubernetes
SOURCE_VERSION=1.20.5+really1.20.2-1.1+deb12u1
SOURCE_SUITE=bookworm  # the suite that holds SOURCE_VERSION, whatever this machine runs
PACKAGES=(golang-go etcd-server golang-github-modern-go-reflect2-dev rsync jq make openssl)
# kubectl 1.20, unless the machine has a kubectl already (another package's would conflict with it)
KUBECTL_PACKAGE=kubernetes-client
# reflect2 1.0.1, vendored by Kubernetes 1.20, crashes under Go >= 1.18; Debian's 1.0.2 does not.
REFLECT2=github.com/modern-go/reflect2
DEBIAN_GOCODE=/usr/share/gocode/src
# The schema validators vendored by 1.20 take a value equal to its type's zero value for null by
# comparing reflect.Values; under Go >= 1.19 an empty string compares equal (both point at the
# runtime's zero buffer), so a custom resource with a "" field is refused (`status.message:
# Invalid value: "null"`). Later go-openapi and kube-openapi test `data == nil` alone, as this build does.
TYPE_VALIDATORS=(github.com/go-openapi/validate/type.go k8s.io/kube-openapi/pkg/validation/validate/type.go)
ZERO_AS_NULL='if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {'
NEEDED_DISK_KB=$((3 * 1024 * 1024))
BINARIES=(kube-apiserver kube-controller-manager)
WORK=""  # the build tree, deleted on exit

script_hash() { sha256sum "${BASH_SOURCE[0]}" | cut -c1-12; }
cache_dir() { echo "${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/kube-$(script_hash)"; }
log() { echo "build_kube: $*" >&2; }
die() { log "$*"; exit 1; }

built() {
  local dir=$1 name
  for name in "${BINARIES[@]}" etcd kubectl; do [[ -x $dir/$name ]] || return 1; done
}

install_packages() {
  local missing=() pkg wanted=("${PACKAGES[@]}")
  command -v kubectl >/dev/null || wanted+=("$KUBECTL_PACKAGE")
  for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  [[ $(id -u) == 0 ]] || die "missing Debian packages (install them as root): ${missing[*]}"
  log "installing ${missing[*]}"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

check_disk() {
  local dir=$1 free_kb
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  ((free_kb >= NEEDED_DISK_KB)) ||
    die "$((free_kb / 1024)) MB free under $dir; the build needs $((NEEDED_DISK_KB / 1024)) MB (set TMPDIR elsewhere)"
}

# The machine's own Debian mirror (deb822 or one-line sources), so the download goes where apt goes.
debian_mirror() {
  local uri
  uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [[ -n $uri ]] || uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

fetch_source() {
  local work=$1 apt=$1/apt
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(debian_mirror) $SOURCE_SUITE main" \
    >"$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root -qq)
  apt-get "${opts[@]}" update >&2
  (cd "$work" && apt-get "${opts[@]}" source --download-only "$SOURCE_PACKAGE=$SOURCE_VERSION" >&2)
  tar -xzf "$work"/"${SOURCE_PACKAGE}_${SOURCE_VERSION%%-*}".orig.tar.gz -C "$work"
  local trees=("$work"/kubernetes-*/)
  [[ ${#trees[@]} == 1 && -f ${trees[0]}/Makefile ]] || die "unexpected source layout in $work"
  echo "${trees[0]%/}"
}

replace_reflect2() {
  local vendored=$1/vendor/$REFLECT2 debian=$DEBIAN_GOCODE/$REFLECT2
  [[ -d $vendored && -d $debian ]] || die "reflect2 not found ($vendored, $debian)"
  rm -f "$vendored"/*.go "$vendored"/*.s
  cp "$debian"/*.go "$debian"/*.s "$vendored"/
  rm -f "$vendored"/*_test.go
}

patch_type_validators() {
  local file
  for file in "${TYPE_VALIDATORS[@]}"; do
    file=$1/vendor/$file
    grep -qF "$ZERO_AS_NULL" "$file" || die "$file: the zero-as-null test to patch is not there"
    ZERO_AS_NULL=$ZERO_AS_NULL perl -pi -e 's/\Q$ENV{ZERO_AS_NULL}\E/if data == nil {/' "$file"
    ! grep -qF "$ZERO_AS_NULL" "$file" || die "$file: patching the zero-as-null test failed"
  done
}

compile() {
  local tree=$1 work=$2
  cat >"$work/version" <<EOF
KUBE_GIT_VERSION='$KUBE_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
KUBE_GIT_TREE_STATE='clean'
EOF
  local what=() name
  for name in "${BINARIES[@]}"; do what+=("cmd/$name"); done
  # Plain `go build` lacks the generated OpenAPI code: the Makefile generates it first.
  (cd "$tree" && env CGO_ENABLED=0 GOCACHE="$work/gocache" GOPATH="$work/gopath" GOFLAGS= GO111MODULE= \
    KUBE_GIT_VERSION_FILE="$work/version" HOME="$work" make WHAT="${what[*]}" >&2)
}

# Builds of earlier versions of this script: ~210 MB each, used by nothing.
prune_other_builds() {
  local keep=$1 dir
  for dir in "$(dirname "$keep")"/kube-*; do
    [[ $dir == "$keep" || $dir == "$keep.lock" ]] || rm -rf "$dir"
  done
}

remove_work() {
  [[ -n $WORK && -d $WORK ]] || return 0
  chmod -R u+w "$WORK" 2>/dev/null || true  # Go leaves read-only files behind
  rm -rf "$WORK"
}

main() {
  local cache tree name
  cache=$(cache_dir)
  if built "$cache"; then echo "$cache"; return; fi
  install_packages
  mkdir -p "$(dirname "$cache")"
  exec 9>"$cache.lock"
  flock 9  # another build of the same script: wait for it, then use its result
  if built "$cache"; then echo "$cache"; return; fi
  check_disk "${TMPDIR:-/tmp}"
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/build-kube.XXXXXX")
  trap remove_work EXIT
  log "building kube-apiserver and kube-controller-manager $KUBE_VERSION in $WORK (about 8 minutes)"
  tree=$(fetch_source "$WORK")
  replace_reflect2 "$tree"
  patch_type_validators "$tree"
  compile "$tree" "$WORK"
  rm -rf "$cache.partial"
  mkdir -p "$cache.partial"
  for name in "${BINARIES[@]}"; do cp "$tree/_output/bin/$name" "$cache.partial/$name"; done
  ln -s "$(command -v etcd)" "$cache.partial/etcd"
  ln -s "$(command -v kubectl)" "$cache.partial/kubectl"
  "$cache.partial/kube-apiserver" --version >&2
  rm -rf "$cache"
  mv "$cache.partial" "$cache"
  prune_other_builds "$cache"
  log "done: $cache"
  echo "$cache"
}

main "$@"
