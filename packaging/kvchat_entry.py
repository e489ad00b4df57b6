"""Entry point of the packaged app (PyInstaller needs a script)."""
import sys

from kvchat.cli.launcher import main

sys.exit(main())
