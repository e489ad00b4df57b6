#!/usr/bin/env bash
# The wheel works on its own, not only the editable install: built from the checkout, installed in
# a new venv, and run as a user runs it (--help, generate on the starter, the app's QML and icons
# loaded offscreen). The new venv sees kvchat's dependencies from .venv through a .pth line, so
# nothing is downloaded again; kvchat itself comes only from the wheel (checked).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv_python="$root/.venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$venv_python" -m pip wheel --no-deps --no-build-isolation -q -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/kvchat-*.whl)
"$venv_python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for wanted in ("kvchat/app/qml/ChatView.qml", "kvchat/app/assets/personas.json", "kvchat/app/assets/icons/send.svg",
               "kvchat/bench/shapes/llama-3.1-8b.json", "kvchat/kernels/int8_rows.cpp",
               "kvchat/kernels/decode_attention.cpp"):
    assert wanted in names, f"the wheel lacks {wanted}"
print(f"wheel: {len(names)} files, package data included")
EOF

"$venv_python" -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
deps=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
(cd "$site" && "$venv_python" -m zipfile -e "$wheel" .)
echo "$deps" > "$site/zz-kvchat-dependencies.pth"
# the console script, as pip would write it
printf '#!%s\nimport sys\nfrom kvchat.cli.launcher import main\nsys.exit(main())\n' "$work/venv/bin/python" > "$work/venv/bin/kvchat"
chmod +x "$work/venv/bin/kvchat"

export KVCHAT_HOME="$work/home" QT_QPA_PLATFORM=offscreen QT_QUICK_BACKEND=software HF_HUB_OFFLINE=1
"$work/venv/bin/python" -c "import kvchat, sys; assert kvchat.__file__.startswith('$site'), kvchat.__file__"
"$work/venv/bin/kvchat" --help > /dev/null
"$work/venv/bin/kvchat" generate --prompt "Say hello." --max-new-tokens 4 --json > "$work/out.json"
"$venv_python" -c "import json; r = json.load(open('$work/out.json')); assert r['token_ids'], r; print('generate:', repr(r['text']))"
"$work/venv/bin/python" - <<'EOF'
from PySide6.QtWidgets import QApplication

from kvchat.app.package_data import ICONS, QML_DIR
from kvchat.app.views.chat_view import ChatView
from kvchat.app.views.icons import icon
from kvchat.app.views.theme import Theme

app = QApplication([])
view = ChatView(Theme("light"))  # raises when the QML does not load
assert not icon("send", "#000000").isNull(), ICONS
print(f"app: the chat view's QML and the icons load from the wheel ({QML_DIR.parent})")
EOF
echo "wheel-check: passed"
