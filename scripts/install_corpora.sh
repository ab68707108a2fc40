#!/bin/sh
# Offline training corpora for `specdecode train heads` / `specdecode train draft`.
# Debian's python3.11-doc puts the Python documentation as HTML under /usr/share/doc/python3.11/html,
# the default corpus (stripped to text); without it the trainers fall back to the running
# interpreter's standard-library source. Needs root (or sudo).
set -eu
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
    SUDO=sudo
else
    SUDO=
fi
$SUDO apt-get install -y python3.11-doc
