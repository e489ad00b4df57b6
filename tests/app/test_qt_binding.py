"""The Qt binding kvchat installs keeps Python's reference counts: PySide6 6.12.0 dropped one
reference to None in every call of some methods that return nothing, and on Python 3.11 (where
None is not immortal) the app aborted with "deallocating None" after some thousands of calls."""
import sys

from PySide6.QtWidgets import QToolButton


def test_calls_that_return_nothing_keep_nones_reference_count(qtbot):
    button = QToolButton()
    qtbot.addWidget(button)
    before = sys.getrefcount(None)
    for i in range(2000):
        button.setText(str(i % 2))
        button.setHidden(False)
    assert abs(sys.getrefcount(None) - before) < 50  # 6.12.0: 4,000 fewer
