#!/bin/sh
# Install mtpserve's systemd units and configuration.
#   scripts/install-systemd.sh [--root DIR] [--prefix DIR] [--no-user]
# --prefix: where the repository (and its .venv/) lives (default: this checkout).
# --root:   install into DIR instead of / (packaging, tests); implies --no-user and no daemon-reload.
set -eu
ROOT=/
PREFIX=$(cd "$(dirname "$0")/.." && pwd)
MAKE_USER=1
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=$2; shift 2 ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --no-user) MAKE_USER=0; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
[ "$ROOT" = / ] || MAKE_USER=0
SRC=$(cd "$(dirname "$0")/.." && pwd)
UNITS="$ROOT/etc/systemd/system"
mkdir -p "$UNITS" "$ROOT/etc/mtpserve"
for unit in "$SRC"/systemd/*.service; do
    sed "s|/opt/mtpserve|$PREFIX|g" "$unit" > "$UNITS/$(basename "$unit")"
    chmod 0644 "$UNITS/$(basename "$unit")"
done
# Never overwrite an operator's configuration.
[ -e "$ROOT/etc/mtpserve/mtpserve.toml" ] || cp "$SRC/config/mtpserve.example.toml" "$ROOT/etc/mtpserve/mtpserve.toml"
[ -e "$ROOT/etc/mtpserve/router.env" ] || cp "$SRC/systemd/router.env.example" "$ROOT/etc/mtpserve/router.env"
if [ "$MAKE_USER" = 1 ]; then
    id mtpserve >/dev/null 2>&1 || useradd --system --home-dir /var/lib/mtpserve --shell /usr/sbin/nologin mtpserve
    [ -d /run/systemd/system ] && systemctl daemon-reload
fi
echo "installed units into $UNITS (prefix $PREFIX)"
