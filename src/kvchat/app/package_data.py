"""Files that ship inside the package: the QML chat view, the icons, the default personas. Found
through importlib.resources, so a wheel, an editable install and the PyInstaller bundle (which
places them under kvchat/app/ too) all read the same paths."""
from importlib.resources import files
from pathlib import Path

APP = Path(str(files("kvchat.app")))
ASSETS = APP / "assets"
ICONS = ASSETS / "icons"
QML_DIR = APP / "qml"
