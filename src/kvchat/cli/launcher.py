"""The ``kvchat`` command: no arguments start the desktop app, anything else is the command line.

This is where the layers meet: the app gets the local engine's maker from here, for the app itself
imports no engine (and so no torch) of its own."""
import ctypes.util
import logging
import os
import sys

XCB_PACKAGES = {"xcb-cursor": "libxcb-cursor0", "xcb-icccm": "libxcb-icccm4", "xcb-keysyms": "libxcb-keysyms1",
                "xkbcommon-x11": "libxkbcommon-x11-0"}


def missing_xcb_packages() -> list[str]:
    return [pkg for lib, pkg in XCB_PACKAGES.items() if ctypes.util.find_library(lib) is None]


def display_problem() -> str | None:
    """One line saying why no window can open here, or None."""
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if sys.platform.startswith("linux") and not platform:
        if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
            return "kvchat: no display found (DISPLAY is not set); for the terminal chat run: kvchat chat"
        if os.environ.get("WAYLAND_DISPLAY"):
            return None
        missing = missing_xcb_packages()
        if missing:
            return ("kvchat: Qt's xcb platform needs system libraries that are missing; install them with: "
                    f"sudo apt-get install {' '.join(missing)}")
        display = os.environ["DISPLAY"]
        if not x_server_answers(display):
            # else Qt aborts the process, with a hint about libxcb-cursor0 whatever the cause
            return (f"kvchat: no X server answers on DISPLAY={display}; start one or set DISPLAY to it, or for "
                    "the terminal chat run: kvchat chat")
    return None


def x_server_answers(display: str) -> bool:
    """Whether ``display``'s X server takes a connection, asked through libxcb as Qt's xcb
    platform asks it (the same names, sockets and authorization); True where libxcb is not found,
    for Qt to say."""
    name = ctypes.util.find_library("xcb")
    if name is None:
        return True
    xcb = ctypes.CDLL(name)
    xcb.xcb_connect.restype, xcb.xcb_connect.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    connection = xcb.xcb_connect(display.encode(), None)  # never NULL: an error connection on failure
    try:
        return xcb.xcb_connection_has_error(connection) == 0
    finally:
        xcb.xcb_disconnect(connection)


def local_engine(config):
    """The local engine for ``config``; called on the app's worker thread, as its imports (torch,
    transformers) take seconds."""
    from kvchat.engine.engine import Engine

    return Engine(config)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from kvchat.engine.toolchain import quiet_torch_openmp

    quiet_torch_openmp()  # before anything imports torch
    if argv[:2] == ["bench", "ui"]:  # the GUI's own benchmark: the engine's CLI knows nothing of Qt
        from kvchat.bench.ui import main as bench_ui

        return bench_ui(argv[2:])
    if argv:
        from kvchat.cli.main import main as cli_main

        return cli_main(argv)
    problem = display_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    from kvchat.app.main import run

    code = run(local_engine)
    # The engine's thread may still be inside torch (compiling, reading a GGUF) when the window
    # closes; interpreter shutdown would stop it mid-C++ and abort the process ("terminate called
    # without an active exception", exit 134). The database holds everything by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
