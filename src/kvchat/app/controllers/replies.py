"""The replies in the window: send (or resend an edit, or regenerate), the tokens as they stream,
the end (finished, stopped, failed), and the message that waits for the model to load. Each chat may
have one reply being written, and several chats may at once (the engine batches them): Send, Stop,
Regenerate and Edit act on the chat in view only. A reply is saved as it streams, marked interrupted
until it ends."""
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer

from kvchat.app.controllers.conversations import STREAMING_NOTICE
from kvchat.app.controllers.loop_guard import LoopGuard
from kvchat.app.store import engine_messages

SAVE_EVERY_S = 0.5  # a streaming reply is saved this often, marked interrupted until it ends
RENDER_EVERY_MS = 66  # tokens arriving faster than this are shown together (15 frames a second)
WAITING_NOTE = "The model is loading: this message will be answered when it is ready."
EDITING_NOTICE = "editing: Resend replaces the message and the replies after it; Escape cancels"
SEND_AFTER_STOP = "stopping the reply: your message is sent as soon as it has stopped"
BUSY_NOTICE = "a reply is being written in this chat: stop it first (Stop or Escape), then send"
WAITING_ALREADY = "a message already waits for the model to load: it is answered first"


@dataclass
class Reply:
    """One reply being written: where it goes and what it has so far."""
    reply_id: int  # its message in the store
    conversation: int
    new_version: bool  # it streams as a new version of an existing reply (regenerate)
    key: int | None = None  # the bridge's
    text: str = ""
    ids: list = field(default_factory=list)
    last_save: float = field(default_factory=time.monotonic)
    loop_guard: LoopGuard = field(default_factory=LoopGuard)
    loop_stopped: bool = False
    stopping: bool = False  # the user stopped it; its end has not arrived yet
    send_after_stop: bool = False  # the user sent in its chat while it was stopping: sent once it has

    def add(self, text: str, token_id: int) -> bool:
        """A streamed token; True the first time the reply is caught repeating itself."""
        self.text += text
        if token_id < 0:
            return False
        self.ids.append(token_id)
        if self.loop_guard.add(token_id) and not self.loop_stopped:
            self.loop_stopped = True
            return True
        return False


class ReplyController(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store, self.bridge = win, win.store, win.bridge
        self.live: dict[int, Reply] = {}  # the replies being written, by the bridge's key
        self.waiting: int | None = None  # a chat whose last message waits for the model to load
        self.editing: int | None = None  # the position of the user message being edited in the box
        self.render_timer = QTimer(win, singleShot=True, interval=RENDER_EVERY_MS)
        self.render_timer.timeout.connect(self.show_stream)

    def of(self, conversation_id: int | None) -> Reply | None:
        """The reply being written in that chat, if one is."""
        return next((r for r in self.live.values() if r.conversation == conversation_id), None)

    @property
    def shown(self) -> Reply | None:
        """The reply being written in the chat in view."""
        return self.of(self.win.conversation_id) if self.win.conversation_id is not None else None

    def persona_of(self, conversation_id: int) -> dict | None:
        return self.win.personas.persona(self.store.conversation(conversation_id)["persona_id"])

    def use_prompt(self, text: str) -> None:
        """An example prompt from the empty chat: sent as if typed."""
        self.win.input.setPlainText(text)
        self.send()

    def send(self) -> None:
        win = self.win
        text = win.input.toPlainText().strip()
        if not text:
            return
        if problem := win.input.too_long():  # kept in the box: shortened, or sent once the context is raised
            return win.notify(problem)
        reply = self.shown
        if reply is not None:  # never a silent no: say why, and after a Stop send it once the reply has ended
            reply.send_after_stop = reply.stopping
            win.notify(SEND_AFTER_STOP if reply.stopping else BUSY_NOTICE)
            return
        if self.waiting is not None:
            win.notify(WAITING_ALREADY)
            return
        if self.editing is not None:
            position = self.editing
            self.stop_editing()
            win.input.clear()
            self.edit_and_resend(position, text)
            return
        if win.conversation_id is None:
            win.chats.new()
        if not self.store.messages(win.conversation_id):
            self.store.rename_conversation(win.conversation_id, text.splitlines()[0][:40])
        win.input.clear()
        self.store.add_message(win.conversation_id, "user", text)
        win.chats.refresh()
        if self.bridge.loading:  # answered by answer_waiting once the model is ready
            self.waiting = win.conversation_id
            win.notify(WAITING_NOTE)
            win.render_chat()
            return
        self.start()

    def regenerate(self) -> None:
        cid = self.win.conversation_id
        if cid is None or self.shown is not None or self.bridge.loading:
            return
        messages = self.store.messages(cid)
        if messages and messages[-1].role == "assistant":  # the reply before stays, as a version
            self.start(cid, version_of=messages[-1].id)
        elif messages:
            self.start()

    def show_version(self, position: int, idx: int) -> None:
        """Another version of the reply at ``position``: read from the store, nothing computed."""
        cid = self.win.conversation_id
        message = next((m for m in self.store.messages(cid) if m.position == position), None) if cid else None
        streaming = message is not None and any(r.reply_id == message.id for r in self.live.values())
        if message is None or streaming or not 0 <= idx < message.versions:
            return
        self.store.show_version(message.id, idx)
        self.win.render_chat()

    def stop(self) -> None:
        """Stop stops the reply of the chat in view, and only it."""
        reply = self.shown
        if reply is not None:
            reply.stopping = True
            self.bridge.stop(reply.key)

    def leave(self) -> None:
        """Another chat opens: a message waiting for this chat's reply to stop stays in the box, unsent."""
        reply = self.shown
        if reply is not None and reply.send_after_stop:
            reply.send_after_stop = False
            self.win.clear_notice(SEND_AFTER_STOP)

    def stop_all(self) -> None:
        """A model change: every reply stops where it is."""
        for reply in list(self.live.values()):
            reply.stopping = True
            self.bridge.stop(reply.key)

    def begin_edit(self, position: int) -> None:
        """Put a user message back in the input box; Send then replaces it and what followed."""
        win = self.win
        message = next((m for m in self.store.messages(win.conversation_id) if m.position == position), None)
        if message is None or message.role != "user" or self.shown is not None:
            return
        self.editing = position
        win.input.setPlainText(message.content)
        win.input.setFocus()
        win.send_button.setText("Resend")
        win.notify(EDITING_NOTICE)

    def stop_editing(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.win.send_button.setText("Send")
            self.win.clear_notice(EDITING_NOTICE)

    def edit_and_resend(self, position: int, text: str) -> None:
        """Replace the user message at ``position`` and everything after it."""
        if self.shown is not None or self.bridge.loading or not text.strip():
            return
        self.store.truncate(self.win.conversation_id, position)
        self.store.add_message(self.win.conversation_id, "user", text.strip())
        self.start()

    def start(self, conversation_id: int | None = None, version_of: int | None = None) -> None:
        """A reply to the chat as it stands; ``version_of``: a reply to write again, as a new version."""
        win = self.win
        conversation_id = conversation_id or win.conversation_id
        persona = self.persona_of(conversation_id)  # the author: a later change of persona does not rename it
        messages = engine_messages(self.store.messages(conversation_id), persona, leave_out=version_of)
        if version_of is not None:
            self.store.new_version(version_of, persona)
            reply = Reply(version_of, conversation_id, new_version=True)
        else:
            reply_id = self.store.add_message(conversation_id, "assistant", "", interrupted=True, persona=persona)
            reply = Reply(reply_id, conversation_id, new_version=False)
        reply.key = self.bridge.send(messages, win.sampling)
        if reply.key is None:  # refused: the bridge's failed signal says why
            self.save_or_drop(reply, "", [], None, interrupted=True)
        else:
            self.live[reply.key] = reply
        win.render_chat(refresh=True, follow=conversation_id == win.conversation_id)  # a waiting one may be elsewhere

    def update_buttons(self) -> None:
        """Stop stands where Send was while the chat in view has a reply being written; the top bar
        counts the replies being written in every chat."""
        win, on = self.win, self.shown is not None
        win.send_button.setEnabled(not on)
        win.send_button.setVisible(not on)
        win.stop_button.setEnabled(on)
        win.stop_button.setVisible(on)
        win.running_button.show_titles([self.store.conversation(r.conversation)["title"] for r in self.live.values()])

    def show_next(self) -> None:
        """The running-replies button: the next chat with a reply being written, after the one in view."""
        chats = sorted(r.conversation for r in self.live.values())
        later = [c for c in chats if self.win.conversation_id is None or c > self.win.conversation_id]
        if chats:
            self.win.chats.open((later or chats)[0])

    def answer_waiting(self) -> None:
        """The message sent while the model loaded gets its reply now."""
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self.start(waiting)

    def on_token(self, key: int, text: str, token_id: int) -> None:
        reply = self.live.get(key)
        if reply is None:
            return
        if reply.add(text, token_id):
            self.bridge.stop(key)
            self.win.notify(f"stopped the reply: it was repeating its last {reply.loop_guard.window} tokens")
        if time.monotonic() - reply.last_save > SAVE_EVERY_S:
            self.store.update_message(reply.reply_id, reply.text, reply.ids, interrupted=True)
            reply.last_save = time.monotonic()
        if self.win.conversation_id == reply.conversation and not self.render_timer.isActive():
            self.render_timer.start()  # only while its chat is in view: another one is not redrawn under the reader

    def save_so_far(self) -> None:
        """At quit: each streaming reply as the user last saw it, marked interrupted. The engine's
        cancelled end would arrive through the event loop, which has stopped by then, and the last
        periodic save is up to ``SAVE_EVERY_S`` behind the screen."""
        for reply in self.live.values():
            self.save_or_drop(reply, reply.text, reply.ids, None, interrupted=True)

    def save_or_drop(self, reply: Reply, text: str, ids, stats, interrupted: bool) -> None:
        """A reply cut before its first word is not kept: no empty "interrupted" reply in the chat."""
        if interrupted and not text:
            if reply.new_version:
                self.store.drop_version(reply.reply_id)
            else:
                self.store.delete_message(reply.reply_id)
            return
        self.store.update_message(reply.reply_id, text, ids, stats, interrupted=interrupted)

    def show_stream(self) -> None:
        """The streaming reply's row, and only it, shows the text so far."""
        reply = self.shown
        if reply is not None:
            self.win.chat_view.model.set_text(reply.reply_id, reply.text)

    def on_finished(self, key: int, done: dict) -> None:
        reply = self.live.pop(key, None)
        if reply is None:
            return
        cancelled = done["finish_reason"] == "cancelled"
        text = reply.text if cancelled else done["text"]
        stats = done["stats"]
        if cancelled and reply.loop_stopped:  # a finished reply, not an interrupted one
            stats = {**stats, "finish_reason": "loop"}
        self.save_or_drop(reply, text, done["token_ids"] or reply.ids, stats,
                          interrupted=cancelled and not reply.loop_stopped)
        self.end(reply)

    def on_reply_failed(self, key: int, message: str) -> None:
        reply = self.live.pop(key, None)
        if reply is None:
            return
        self.store.update_message(reply.reply_id, reply.text or f"*Error: {message}*", reply.ids, interrupted=True)
        self.end(reply)
        self.win.notify(f"error: {message}")

    def on_failed(self, message: str) -> None:
        """A command the backend refused (a send while a model loads, a reconfigure)."""
        self.win.notify(f"error: {message}")

    def end(self, reply: Reply) -> None:
        win = self.win
        in_view = reply.conversation == win.conversation_id
        if in_view:
            win.clear_notice(STREAMING_NOTICE)
            self.render_timer.stop()
        self.update_buttons()
        win.personas.update_badge()
        if in_view:
            win.render_chat(refresh=True)
            if reply.send_after_stop:
                self.send()
