#!/usr/bin/env bash
# Build a local Debian base image (python3, venv, pip) from Debian's packages, for sites that cannot pull
# from a registry: debootstrap a root filesystem from the host's own apt mirror, add the host's CA
# certificates, and `docker import` it. Nothing is pulled.
#
#   deploy/docker/build-base.sh [--force] [TAG]      (default TAG: sparkrl-base:bookworm)
#
# Then: docker build --build-arg BASE_IMAGE=sparkrl-base:bookworm -f deploy/docker/Dockerfile.cpu .
# An image already present under TAG is kept (--force rebuilds it). Runs as root (debootstrap needs it).
# SUITE (default bookworm: its python3 is 3.11, the CPU torch wheel's) and MIRROR override what is read
# from the host's apt configuration.
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then
    force=1
    shift
fi
TAG="${1:-sparkrl-base:bookworm}"
SUITE="${SUITE:-bookworm}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

log() { echo "build-base: $*" >&2; }

if [ "$force" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    log "$TAG is already there (--force rebuilds it)"
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap >/dev/null
fi

# The first URI of an enabled apt source that serves "$1" (a suite): one-line `deb URI SUITE ...` files
# (sources.list, *.list) and deb822 stanzas (*.sources: URIs:/Suites:/Enabled:). apt itself reads only
# those names, so neither does this (`*.disabled` files are skipped).
apt_uri_for() {
    local suite="$1" file
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$file" ] || continue
        awk -v suite="$suite" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }   # [ options ]
                if ($(i + 1) == suite) { print $i; exit }
            }' "$file"
    done
    for file in /etc/apt/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        awk -v suite="$suite" '
            function flush() {
                if (uris != "" && enabled && types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ")) {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                uris = ""; suites = ""; types = ""; enabled = 1
            }
            BEGIN { enabled = 1 }
            /^[ \t]*$/ { flush(); next }
            /^#/ { next }
            tolower($1) == "types:" { $1 = ""; types = $0 }
            tolower($1) == "uris:" { $1 = ""; uris = $0 }
            tolower($1) == "suites:" { $1 = ""; suites = $0 }
            tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
            END { if (!found) flush() }' "$file"
    done
}

MIRROR="${MIRROR:-$(apt_uri_for "$SUITE" | head -n1)}"
SECURITY="$(apt_uri_for "$SUITE-security" | head -n1)"
if [ -z "$MIRROR" ]; then
    log "no apt source for suite $SUITE in /etc/apt/sources.list{,.d/}: set MIRROR=http://.../debian"
    exit 1
fi
log "suite $SUITE from $MIRROR${SECURITY:+ (security: $SECURITY)}"

root="$(mktemp -d "${TMPDIR:-/tmp}/sparkrl-base.XXXXXX")"
cleanup() { $SUDO rm -rf --one-file-system "$root"; }
trap cleanup EXIT

# minbase: only what apt needs; python3-venv brings ensurepip, python3-pip a system pip for bootstrapping.
$SUDO debootstrap --variant=minbase \
    --include=ca-certificates,python3,python3-venv,python3-pip \
    "$SUITE" "$root" "$MIRROR" >&2

# apt inside the image uses the same mirror (a Dockerfile's apt-get install must find its packages).
{
    echo "deb $MIRROR $SUITE main"
    echo "deb $MIRROR $SUITE-updates main"
    [ -n "$SECURITY" ] && echo "deb $SECURITY $SUITE-security main"
} | $SUDO tee "$root/etc/apt/sources.list" >/dev/null

# The host's CA certificates: where HTTPS is re-signed by a proxy, pip in the image needs its CA or fails
# with a bare "No matching distribution". Kept under /usr/local/share/ca-certificates so a later
# update-ca-certificates (any package that triggers it) keeps them in the bundle.
host_bundle=""
for candidate in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    [ -f "$candidate" ] && { host_bundle="$candidate"; break; }
done
if [ -n "$host_bundle" ]; then
    $SUDO cp "$host_bundle" "$root/usr/local/share/ca-certificates/sparkrl-host-bundle.crt"
fi
if [ -d /usr/local/share/ca-certificates ]; then
    $SUDO find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' \
        -exec cp {} "$root/usr/local/share/ca-certificates/" \;
fi
$SUDO chroot "$root" update-ca-certificates >/dev/null 2>&1 || log "warning: update-ca-certificates failed"

$SUDO chroot "$root" apt-get clean
$SUDO rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/tmp/* "$root"/var/log/*.log

log "importing as $TAG"
$SUDO tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $SUITE from $MIRROR" \
    - "$TAG" >/dev/null
docker run --rm --network none "$TAG" python3 -c 'import ensurepip, ssl, sys; print("build-base: python", sys.version.split()[0])' >&2
log "done: $TAG"
