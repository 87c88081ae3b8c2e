#!/bin/sh
# Debian packages the build and the tests need. As root: installs what is missing. Otherwise: names
# what to install and stops.
set -eu
PACKAGES="python3 python3-venv python3-dev g++ make systemd libibverbs1"
missing=""
for p in $PACKAGES; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
# A Python built outside Debian (pyenv, a container image) brings its own venv and headers.
if python3 -c 'import venv, sysconfig, os; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then
    missing=$(echo "$missing" | tr ' ' '\n' | grep -v -x -e python3 -e python3-venv -e python3-dev | tr '\n' ' ')
fi
missing=$(echo "$missing" | xargs)
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages; as root run: apt-get update && apt-get install -y $missing" >&2
    exit 1
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
