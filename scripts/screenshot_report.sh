#!/bin/sh
# Render a bench report.html to a PNG with headless Chromium (Debian: apt-get install chromium).
# Usage: scripts/screenshot_report.sh runs/<time>/report.html docs/report.png [width] [height]
set -eu
html=$(realpath "$1")
out=$2
width=${3:-1200}
height=${4:-2400}
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --window-size="$width,$height" \
  --screenshot="$(realpath -m "$out")" "file://$html" 2>/dev/null
echo "wrote $out"
