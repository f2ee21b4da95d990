#!/usr/bin/env bash
# Install the Debian packages the tests need beyond Python, if any is missing.
#
#   sudo bash scripts/test-deps.sh        # .ci/run calls it before the test command
#
# - openssh-server, openssh-client: tests/test_ssh_launch.py runs MXNet's ssh launcher across
#   network namespaces, each running its own sshd (temp keys and config, never /etc/ssh).
# - nftables, iptables: packet filtering inside the tests' network namespaces (emunet's random
#   loss per link is an nft rule in the switch namespace).
# - ethtool: emunet turns segmentation/receive offloads (GSO, TSO, GRO) off on its veths, so
#   shaping and loss act per packet on the wire, not per 64 KB super-packet.
#
# Idempotent and quiet: when every package is installed it prints nothing and touches nothing
# (no `apt-get update`, no network). Otherwise it runs `apt-get update` once, installs only
# the missing packages (no recommends), prints one line with the time it took, and on failure
# prints apt's output. Needs root and apt (Debian/Ubuntu).
#
# No service is started by the install: an sshd listening on every interface of the machine
# is exactly what the tests must not create. Where the image does not already forbid service
# starts (/usr/sbin/policy-rc.d, as Debian's container images ship it), a temporary
# policy-rc.d answering 101 ("action forbidden", the interface invoke-rc.d and
# deb-systemd-invoke consult) is put in place for the duration of the install and removed
# afterwards.
set -euo pipefail

PACKAGES=(openssh-server openssh-client nftables iptables ethtool)
# Another apt/dpkg run (e.g. unattended upgrades, a colleague's install) holds the lock: wait
# for it rather than fail.
LOCK_WAIT_SECONDS=600

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
    installed "$pkg" || missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "test-deps: ${missing[*]} missing; installing them needs root: sudo bash $0" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "test-deps: ${missing[*]} missing and apt-get not found: install them with this" \
         "system's package manager" >&2
    exit 1
fi

start=$SECONDS
log=$(mktemp /tmp/mxps-test-deps.XXXXXX.log)
policy=/usr/sbin/policy-rc.d
own_policy=0
cleanup() {
    if [ "$own_policy" -eq 1 ]; then rm -f "$policy"; fi
    rm -f "$log"
}
trap cleanup EXIT
if [ ! -e "$policy" ]; then
    own_policy=1
    printf '#!/bin/sh\n# from mxps scripts/test-deps.sh: no service starts\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
fi

apt() {
    DEBIAN_FRONTEND=noninteractive apt-get -q -o "DPkg::Lock::Timeout=$LOCK_WAIT_SECONDS" \
        -o Dpkg::Use-Pty=0 "$@" >>"$log" 2>&1
}
if ! apt update || ! apt install -y --no-install-recommends "${missing[@]}"; then
    cat "$log" >&2
    echo "test-deps: installing ${missing[*]} failed (apt's output above)" >&2
    exit 1
fi
for pkg in "${missing[@]}"; do
    if ! installed "$pkg"; then
        cat "$log" >&2
        echo "test-deps: apt-get finished but $pkg is not installed (apt's output above)" >&2
        exit 1
    fi
done
echo "test-deps: installed ${missing[*]} in $((SECONDS - start)) s"
