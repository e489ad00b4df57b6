#!/bin/sh
# README screenshots of the real app under Xvfb (light and dark, 1600x1000 and 1000x700) into docs/.
set -e
cd "$(dirname "$0")/.."
exec xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python tools/screenshots.py "$@"
