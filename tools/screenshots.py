"""README screenshots: the real app under Xvfb, light and dark, at 1600x1000 and 1000x700, and a
reply with two versions, the model library, a pasted document.

A fresh data folder gets a few earlier chats (for the sidebar's date groups); then a question is
typed with xdotool and the starter's real reply is awaited before each picture.

    xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python tools/screenshots.py [--out docs]
"""
import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Write a Python function that reverses a string, with a short example."
EARLIER = [("Plan a weekend in Lisbon", 0), ("Explain the KV cache", 1), ("Regex for dates", 3),
           ("Summarise this email", 5), ("Rust lifetimes question", 12), ("Birthday poem for Ana", 40)]
SIZES = [(1600, 1000), (1000, 700)]
VERSIONS = ["Sage green: it is calm, hides splashes, and goes with wood and white tiles.",
            "Warm white: it makes a small kitchen look larger and brighter in the morning light."]
DOCUMENT = "Quarterly report: the cache team\n" + " ".join(  # a pasted page, past the 2,000-character chip threshold
    ["The prefix cache served most prompt tokens this quarter, and the memory governor kept every chat within "
     "its context without trimming a persona."] * 20)


def seed(home: Path, theme: str) -> Path:
    from kvchat.app.store import Store

    for old in (home / "data").glob("chat.db*"):  # the other theme's chats; the converted model stays
        old.unlink()
    store = Store(home / "data" / "chat.db")
    now = time.time()
    for title, days in EARLIER:
        cid = store.create_conversation(title)
        store.add_message(cid, "user", title)
        store.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now - days * 86400 - 60, cid))
    # a reply written twice (Regenerate): the app opens this chat first, its ‹ 2/2 › in view
    cid = store.create_conversation("Name a colour for a kitchen")
    store.add_message(cid, "user", "Name a colour for a kitchen, and say why in one line.")
    reply = store.add_message(cid, "assistant", VERSIONS[0])
    store.new_version(reply, None)
    store.update_message(reply, VERSIONS[1])
    store.set_setting("last_chat", cid)
    store.set_setting("theme", theme)
    store.set_setting("memory_panel", True)
    store.close()
    return home / "data" / "chat.db"


def xdotool(*args: str) -> str:
    return subprocess.run(["xdotool", *args], capture_output=True, text=True).stdout.strip()


def wait_for(what, timeout: float, step: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(step)
    raise SystemExit(f"timed out after {timeout} s")


def reply_done(db: Path, replies: int) -> bool:
    """The ``replies``-th reply (the seeded one counts) has been written to its end."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT content, interrupted FROM messages WHERE role='assistant'").fetchall()
    return len(rows) >= replies and rows[-1][0].strip() and not rows[-1][1]


def compile_settled(pid: int) -> None:
    """Wait for the first start's compile: a child compiles the decode step, then the app loads it
    from the cache on a thread of its own for 20-25 s, and meanwhile the GUI thread, short of the
    GIL, drew the library dialog black."""
    import psutil

    app = psutil.Process(pid)

    def compiling() -> bool:
        for child in app.children():
            try:
                if "compile_graphs" in " ".join(child.cmdline()):
                    return True
            except psutil.Error:  # it ended: a zombie until the app reaps it
                pass
        return False

    wait_for(lambda: not compiling(), 600, 1.0)
    time.sleep(40.0)


def snap(window: str, target: Path) -> None:
    subprocess.run(["import", "-window", window, str(target)], check=True)
    print(target)


def library(theme: str, out: Path) -> None:
    """The model library (Ctrl+L) with the starter, loaded, and its fit badge; then closed."""
    xdotool("key", "ctrl+l")
    dialog = wait_for(lambda: xdotool("search", "--onlyvisible", "--name", "^Models on this computer$"), 30)
    dialog = dialog.split()[0]
    time.sleep(10.0)  # the scan of the model folders (3 s showed "Looking for models…")
    snap(dialog, out / f"screenshot-{theme}-library.png")
    xdotool("key", "--window", dialog, "Escape")
    time.sleep(4.0)  # with no window manager, the window under the dialog stayed black for a second or two


def attachment(window: str, db: Path, theme: str, out: Path) -> None:
    """A pasted document: a chip in the composer, then in the sent message while its prefill runs."""
    subprocess.run(["xclip", "-selection", "clipboard"], input=DOCUMENT.encode(), check=True)
    xdotool("windowfocus", "--sync", window)
    xdotool("key", "ctrl+n")
    xdotool("type", "--delay", "15", "Summarise this report in three lines:")
    xdotool("key", "ctrl+v")
    time.sleep(1.0)
    snap(window, out / f"screenshot-{theme}-paste.png")
    xdotool("key", "Return")
    time.sleep(4.0)  # the prefill's progress under the reply
    snap(window, out / f"screenshot-{theme}-prefill.png")
    wait_for(lambda: reply_done(db, 3), 600)
    time.sleep(1.5)


def shoot(theme: str, out: Path, app: str, home: Path) -> None:
    db = seed(home, theme)
    env = {**os.environ, "KVCHAT_HOME": str(home)}
    proc = subprocess.Popen([app], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        window = wait_for(lambda: xdotool("search", "--onlyvisible", "--pid", str(proc.pid), "--name", "^kvchat$"), 60)
        window = window.split()[0]
        xdotool("windowsize", window, "1600", "1000")
        xdotool("windowmove", window, "0", "0")
        time.sleep(1.0)
        time.sleep(30.0)  # the model loaded (a GGUF's first conversion included); the chat opened at start
        # holds a reply with two versions
        snap(window, out / f"screenshot-{theme}-versions.png")
        xdotool("windowfocus", "--sync", window)
        xdotool("key", "ctrl+n")
        xdotool("type", "--delay", "15", QUESTION)
        xdotool("key", "Return")
        try:
            wait_for(lambda: reply_done(db, 2), 400)
        except SystemExit:
            subprocess.run(["import", "-window", "root", str(out / f"screenshots-failed-{theme}.png")])
            raise
        compile_settled(proc.pid)
        for width, height in SIZES:
            if width < 1400:  # no room for the memory panel beside the chat
                xdotool("key", "ctrl+m")
            xdotool("windowsize", window, str(width), str(height))
            time.sleep(1.5)
            snap(window, out / f"screenshot-{theme}-{width}x{height}.png")
        xdotool("windowsize", window, "1600", "1000")
        library(theme, out)
        attachment(window, db, theme, out)
    finally:
        proc.terminate()
        proc.wait(15)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--app", default=str(ROOT / ".venv" / "bin" / "kvchat"))
    parser.add_argument("--themes", default="light,dark")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvchat-shots-") as home:  # a fresh user's data: 0.5 GB, gone after
        for theme in args.themes.split(","):
            shoot(theme, out, args.app, Path(home))
    return 0


if __name__ == "__main__":
    sys.exit(main())
