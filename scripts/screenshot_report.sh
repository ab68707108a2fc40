#!/bin/sh
# Render a bench report.html to a PNG with headless Chromium (Debian: scripts/install_chromium.sh),
# checked as the browser test checks it (scripts/report_browser.py): the top HEIGHT px of the page
# WIDTH px wide. Usage: scripts/screenshot_report.sh runs/<time>/report.html docs/report.png [width] [height]
set -eu
out=$2
width=${3:-1200}
height=${4:-2400}
shots=$(mktemp -d)
trap 'rm -rf "$shots"' EXIT
python scripts/report_browser.py "$1" --widths "$width" --height "$height" --shots "$shots"
cp "$shots/report-$width.png" "$out"
echo "wrote $out"
