#!/bin/sh
# Adds kvchat to the desktop's menu: writes kvchat.desktop, with the absolute paths of the app and
# its icon, into $XDG_DATA_HOME/applications (~/.local/share/applications). --uninstall removes it.
#
#   install.sh [--uninstall] [APP_DIR]
#
# APP_DIR is the unpacked app folder (the one holding the kvchat binary and kvchat.svg); by default
# the folder this script is in. Shipped as kvchat/install.sh in the app folder and the .tar.gz;
# `make install-desktop` / `make uninstall-desktop` run it on dist/kvchat.
set -eu

action=install
if [ "${1:-}" = "--uninstall" ]; then action=uninstall; shift; fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,8p' "$0"; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
entry="$apps/kvchat.desktop"

refresh_menu() {
    # Desktops notice the new file on their own; this refreshes the MIME cache where the tool exists.
    if command -v update-desktop-database >/dev/null 2>&1; then update-desktop-database -q "$apps" || true; fi
}

if [ "$action" = uninstall ]; then
    rm -f "$entry"
    refresh_menu
    echo "removed $entry"
    exit 0
fi

app_dir=$(cd "${1:-$here}" && pwd)
binary="$app_dir/kvchat"
icon="$app_dir/kvchat.svg"
[ -x "$binary" ] || { echo "install.sh: no kvchat binary in $app_dir (make package builds it)" >&2; exit 1; }
[ -f "$icon" ] || { echo "install.sh: no kvchat.svg in $app_dir" >&2; exit 1; }
case "$app_dir" in
    *[\"\`\$\\%]*) echo "install.sh: the folder's path has a character a .desktop Exec line cannot hold: $app_dir" >&2
                 exit 1 ;;
esac

mkdir -p "$apps"
tmp_dir=$(mktemp -d)
trap 'rm -rf "$tmp_dir"' EXIT
tmp="$tmp_dir/kvchat.desktop"
cat > "$tmp" <<EOF
[Desktop Entry]
Type=Application
Version=1.4
Name=kvchat
GenericName=Local LLM chat
Comment=Offline chat with local Llama and Qwen models
Exec="$binary"
TryExec=$binary
Path=$app_dir
Icon=$icon
Terminal=false
Categories=Utility;
Keywords=LLM;chat;AI;Llama;Qwen;offline;
StartupNotify=true
StartupWMClass=kvchat
EOF
if command -v desktop-file-validate >/dev/null 2>&1; then
    if ! desktop-file-validate "$tmp"; then echo "install.sh: the entry is not valid" >&2; exit 1; fi
fi
cp "$tmp" "$entry"
refresh_menu
echo "installed $entry -> $binary"
# the decode step compiled for this machine now rather than during the first chat (kvchat prepare);
# the app can be started meanwhile. package-check's entry test skips it (KVCHAT_SKIP_PREPARE=1)
if [ -z "${KVCHAT_SKIP_PREPARE:-}" ]; then
    echo "preparing fast decoding for this computer (a few minutes, once) ..."
    "$binary" prepare || echo "install.sh: kvchat prepare failed; the first start compiles in the background instead" >&2
fi
