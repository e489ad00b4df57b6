"""The chat database: real SQLite files in a temp dir."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from kvchat.app.store import SCHEMA_VERSION, Store, StoreError


def test_conversations_messages_and_search_survive_a_reopen(tmp_path):
    db = tmp_path / "chat.db"
    s = Store(db)
    persona = s.personas()[0]["id"]
    c = s.create_conversation("Trip planning", persona)
    s.add_message(c, "user", "Where is Zermatt?")
    s.add_message(c, "assistant", "In Switzerland.", token_ids=[5, 6, 2], stats={"ttft_ms": 12.5})
    other = s.create_conversation("Recipes")
    s.add_message(other, "user", "Soup please")
    s.close()
    s = Store(db)
    assert [m.content for m in s.messages(c)] == ["Where is Zermatt?", "In Switzerland."]
    assert s.messages(c)[1].token_ids == [5, 6, 2] and s.messages(c)[1].stats == {"ttft_ms": 12.5}
    assert [x["id"] for x in s.conversations("zermatt")] == [c]
    assert [x["id"] for x in s.conversations("recipes")] == [other]
    assert len(s.personas()) == 4  # the defaults from assets/, seeded once


def test_regenerate_and_edit_truncate_and_delete_cascades(tmp_path):
    s = Store(tmp_path / "chat.db")
    c = s.create_conversation()
    for i in range(4):
        s.add_message(c, "user" if i % 2 == 0 else "assistant", f"m{i}")
    s.truncate(c, 2)
    assert [m.content for m in s.messages(c)] == ["m0", "m1"]
    s.delete_conversation(c)
    assert s.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


def test_interrupted_reply_is_kept_and_not_sent_back_as_ids(tmp_path):
    s = Store(tmp_path / "chat.db")
    c = s.create_conversation()
    s.add_message(c, "user", "Hi")
    m = s.add_message(c, "assistant", "", interrupted=True)
    s.update_message(m, "Hel", token_ids=[1, 2], interrupted=True)
    msg = s.messages(c)[1]
    assert msg.interrupted and msg.for_engine() == {"role": "assistant", "content": "Hel"}


def test_export_markdown_and_json(tmp_path):
    s = Store(tmp_path / "chat.db")
    c = s.create_conversation("Export me", s.personas()[0]["id"])
    s.add_message(c, "user", "Hello **there**")
    s.add_message(c, "assistant", "```python\nprint(1)\n```")
    md = s.export_markdown(c)
    assert md.startswith("# Export me") and "## User" in md and "```python" in md
    data = json.loads(s.export_json(c))
    assert data["persona"]["name"] == "Assistant" and [m["role"] for m in data["messages"]] == ["user", "assistant"]


def test_a_database_from_a_newer_kvchat_is_refused_with_a_backup(tmp_path):
    db = tmp_path / "chat.db"
    Store(db).db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(StoreError, match="newer kvchat"):
        Store(db)
    assert list(tmp_path.glob("chat.db.newer-*"))


def test_a_corrupt_database_is_refused_with_a_backup(tmp_path):
    db = tmp_path / "chat.db"
    db.write_bytes(b"this is not a database" * 200)
    with pytest.raises(StoreError, match="damaged"):
        Store(db)
    backups = list(tmp_path.glob("chat.db.broken-*"))
    assert backups and backups[0].read_bytes() == b"this is not a database" * 200


def test_kill_9_mid_reply_leaves_a_consistent_database(tmp_path):
    db = tmp_path / "chat.db"
    writer = textwrap.dedent(f"""
        import time
        from kvchat.app.store import Store
        s = Store({str(db)!r})
        c = s.create_conversation("streaming")
        s.add_message(c, "user", "Tell me a story")
        m = s.add_message(c, "assistant", "", interrupted=True)
        text = ""
        while True:
            text += "word "
            s.update_message(m, text, interrupted=True)
            print(len(text), flush=True)
            time.sleep(0.01)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    for _ in range(20):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    s = Store(db)
    (conv,) = s.conversations()
    user, reply = s.messages(conv["id"])
    assert user.content == "Tell me a story"
    assert reply.interrupted and reply.content.startswith("word word")


V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE personas (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, system_prompt TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
    persona_id INTEGER REFERENCES personas(id) ON DELETE SET NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES conversations(id)
    ON DELETE CASCADE, position INTEGER NOT NULL, role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL, token_ids TEXT, stats TEXT, interrupted INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL, UNIQUE (conversation_id, position));
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO personas VALUES (1, 'Pirate', 'Talk like a pirate.', 0);
INSERT INTO conversations VALUES (1, 'Ahoy', 1, 0, 0), (2, 'Plain', NULL, 0, 0);
INSERT INTO messages VALUES (1, 1, 0, 'user', 'Hi', NULL, NULL, 0, 0), (2, 1, 1, 'assistant', 'Arr!', '[5]', NULL, 0, 0),
    (3, 2, 0, 'user', 'Hi', NULL, NULL, 0, 0), (4, 2, 1, 'assistant', 'Hello.', NULL, NULL, 0, 0);
"""


def test_a_version_1_database_gets_authors_in_place_and_keeps_every_message(tmp_path):
    """Old replies take their chat's persona as the window showed it; the user's personas are not
    seeded over (only a new database gets the defaults)."""
    from kvchat.app.store_schema import prompt_hash

    db = tmp_path / "chat.db"
    raw = sqlite3.connect(db)
    raw.executescript(V1_SCHEMA)
    raw.close()
    s = Store(db)
    pirate, plain = s.messages(1), s.messages(2)
    assert [m.content for m in pirate] == ["Hi", "Arr!"] and pirate[1].token_ids == [5]
    assert (pirate[1].author, pirate[1].author_hash) == ("Pirate", prompt_hash("Talk like a pirate."))
    assert (plain[1].author, plain[1].author_hash, pirate[0].author) == ("Assistant", None, None)
    assert [p["name"] for p in s.personas()] == ["Pirate"]
    assert s.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    s.delete_persona(s.personas()[0]["id"])
    s.close()
    s = Store(db)  # reopened: migrated once, and a deleted persona is not seeded back
    assert s.personas() == [] and s.messages(1)[1].author == "Pirate"
    assert s.conversation(1)["persona_id"] is None


def test_a_replys_versions_follow_edits_and_go_with_it(tmp_path):
    s = Store(tmp_path / "chat.db")
    c = s.create_conversation()
    s.add_message(c, "user", "Hi")
    m = s.add_message(c, "assistant", "One", token_ids=[1], stats={"n": 1})
    assert s.new_version(m, {"name": "Tutor", "system_prompt": "Teach."}) == 1
    s.update_message(m, "Two", token_ids=[2], stats={"n": 2})
    s.show_version(m, 0)
    reply = s.messages(c)[1]
    assert (reply.content, reply.token_ids, reply.author, reply.version, reply.versions) == ("One", [1], "Assistant", 0, 2)
    s.show_version(m, 1)
    assert (s.messages(c)[1].content, s.messages(c)[1].author) == ("Two", "Tutor")
    with pytest.raises(KeyError):
        s.show_version(m, 5)
    s.truncate(c, 1)
    assert s.db.execute("SELECT COUNT(*) FROM reply_versions").fetchone()[0] == 0
