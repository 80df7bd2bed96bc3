#!/usr/bin/env bash
# System packages the project needs (idempotent; runs as root, or via sudo when available).
# - software Vulkan (Mesa >= 24.3 lavapipe) for ManiSkill3/SAPIEN on CPU: Debian bookworm-backports.
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
need_vulkan() {
  ! dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -qE '^(2[4-9]|[3-9][0-9])\.'
}
if need_vulkan; then
  src=/etc/apt/sources.list.d/nexus-backports.sources
  if [ ! -f "$src" ]; then
    # same URIs and keyring as the machine's own Debian source, suite bookworm-backports
    uri=$(grep -hE '^URIs:.*debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')
    key=$(grep -hE '^Signed-By:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')
    uri=${uri:-http://deb.debian.org/debian}; key=${key:-/usr/share/keyrings/debian-archive-keyring.gpg}
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' "$uri" "$key" | $SUDO tee "$src" >/dev/null
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
fi
# - Debian's chromium: headless screenshot test of the dashboard page
if ! command -v chromium >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
echo "system packages ok: mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)"
