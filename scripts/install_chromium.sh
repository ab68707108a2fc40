#!/usr/bin/env bash
# Install Debian's Chromium and the fonts the report's browser test lays text out with
# (tests/test_report_browser.py renders report.html in it); nothing to do when a Chromium is
# already there ($SPECDECODE_CHROMIUM, chromium or chromium-browser). About a minute from a
# Debian mirror. Needs root (or sudo): apt-get.
# Usage: bash scripts/install_chromium.sh
set -euo pipefail
if [ -n "${SPECDECODE_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 \
    || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_chromium.sh: not root and no sudo: install Chromium (Debian: apt-get install -y chromium fonts-dejavu-core fonts-liberation), or set SPECDECODE_CHROMIUM to a Chromium binary" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: no apt-get: install Chromium with your package manager, or set SPECDECODE_CHROMIUM to a Chromium binary" >&2
    exit 1
fi
echo "installing chromium (Debian) for the report's browser test" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-dejavu-core \
    fonts-liberation >/dev/null
