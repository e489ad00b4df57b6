"""A reply's life in the window: send (or resend an edit, or regenerate), the tokens as they stream,
the end (finished, stopped, failed), and the message that waits for the model to load. The reply is
saved as it streams, marked interrupted until it ends."""
import time

from PySide6.QtCore import QObject, QTimer

from kvchat.app.controllers.conversations import STREAMING_NOTICE
from kvchat.app.controllers.loop_guard import LoopGuard

SAVE_EVERY_S = 0.5  # a streaming reply is saved this often, marked interrupted until it ends
RENDER_EVERY_MS = 66  # tokens arriving faster than this are shown together (15 frames a second)
WAITING_NOTE = "The model is loading: this message will be answered when it is ready."
EDITING_NOTICE = "editing: Resend replaces the message and the replies after it; Escape cancels"
WARMING_NOTE = "Preparing fast decoding for this model (up to a minute the first time): the reply starts after it."
SEND_AFTER_STOP = "stopping the reply: your message is sent as soon as it has stopped"
BUSY_NOTICE = "a reply is being written: stop it first (Stop or Escape), then send"
WAITING_ALREADY = "a message already waits for the model to load: it is answered first"


class ReplyController(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store, self.bridge = win, win.store, win.bridge
        self.reply_id: int | None = None
        self.conversation: int | None = None  # the chat a reply streams into; the view may show another
        self.text, self.ids, self.last_save = "", [], 0.0
        self.loop_guard, self.loop_stopped = LoopGuard(), False
        self.waiting: int | None = None  # a chat whose last message waits for the model to load
        self.warming = False  # the engine captures its decode step (CUDA's warm-up notices): a reply waits for it
        self.editing: int | None = None  # the position of the user message being edited in the box
        self.stopping = False  # the user stopped the reply; its end has not arrived yet
        self.send_after_stop = False  # the user sent while it was stopping: sent once it has
        self.new_version = False  # the reply streams as a new version of an existing one (regenerate)
        self.render_timer = QTimer(win, singleShot=True, interval=RENDER_EVERY_MS)
        self.render_timer.timeout.connect(self.show_stream)

    def persona_of(self, conversation_id: int) -> dict | None:
        return self.win.personas.persona(self.store.conversation(conversation_id)["persona_id"])

    def engine_messages(self, conversation_id: int, leave_out: int | None = None) -> list[dict]:
        """The chat as the engine gets it; ``leave_out``: the reply being written again."""
        persona = self.persona_of(conversation_id)
        head = [{"role": "system", "content": persona["system_prompt"]}] if persona else []
        return head + [m.for_engine() for m in self.store.messages(conversation_id) if m.id != leave_out]

    def use_prompt(self, text: str) -> None:
        """An example prompt from the empty chat: sent as if typed."""
        self.win.input.setPlainText(text)
        self.send()

    def send(self) -> None:
        win = self.win
        text = win.input.toPlainText().strip()
        if not text:
            return
        if self.bridge.busy:  # never a silent no: say why, and after a Stop send it once the reply has ended
            self.send_after_stop = self.stopping
            win.notify(SEND_AFTER_STOP if self.stopping else BUSY_NOTICE)
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
        if cid is None or self.bridge.busy or self.bridge.loading:
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
        if message is None or message.id == self.reply_id or not 0 <= idx < message.versions:
            return
        self.store.show_version(message.id, idx)
        self.win.render_chat()

    def stop(self) -> None:
        if self.bridge.busy:
            self.stopping = True
            self.bridge.stop()

    def begin_edit(self, position: int) -> None:
        """Put a user message back in the input box; Send then replaces it and what followed."""
        win = self.win
        message = next((m for m in self.store.messages(win.conversation_id) if m.position == position), None)
        if message is None or message.role != "user" or self.bridge.busy:
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
        if self.bridge.busy or self.bridge.loading or not text.strip():
            return
        self.store.truncate(self.win.conversation_id, position)
        self.store.add_message(self.win.conversation_id, "user", text.strip())
        self.start()

    def start(self, conversation_id: int | None = None, version_of: int | None = None) -> None:
        """A reply to the chat as it stands; ``version_of``: a reply to write again, as a new version."""
        win = self.win
        conversation_id = conversation_id or win.conversation_id
        messages = self.engine_messages(conversation_id, leave_out=version_of)
        self.text, self.ids, self.last_save = "", [], time.monotonic()
        self.loop_guard, self.loop_stopped = LoopGuard(), False
        persona = self.persona_of(conversation_id)  # the author: a later change of persona does not rename it
        self.new_version = version_of is not None
        if version_of is not None:
            self.store.new_version(version_of, persona)
            self.reply_id = version_of
        else:
            self.reply_id = self.store.add_message(conversation_id, "assistant", "", interrupted=True, persona=persona)
        self.conversation = conversation_id
        self._streaming(True)
        self.bridge.send(messages, win.sampling)
        win.render_chat()

    def _streaming(self, on: bool) -> None:
        """Stop stands where Send was while a reply streams."""
        send, stop = self.win.send_button, self.win.stop_button
        send.setEnabled(not on)
        send.setVisible(not on)
        stop.setEnabled(on)
        stop.setVisible(on)

    def answer_waiting(self) -> None:
        """The message sent while the model loaded gets its reply now."""
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            self.start(waiting)

    def on_token(self, text: str, token_id: int) -> None:
        if not self.text and self.warming:
            self.warming = False  # the first token: the decode step is ready, whatever the notices said
            self.win.chat_view.model.set_note("")
        self.text += text
        if token_id >= 0:
            self.ids.append(token_id)
            if self.loop_guard.add(token_id) and not self.loop_stopped:
                self.loop_stopped = True
                self.bridge.stop()
                self.win.notify(f"stopped the reply: it was repeating its last {self.loop_guard.window} tokens")
        if time.monotonic() - self.last_save > SAVE_EVERY_S:
            self.store.update_message(self.reply_id, self.text, self.ids, interrupted=True)
            self.last_save = time.monotonic()
        if self.win.conversation_id == self.conversation and not self.render_timer.isActive():
            self.render_timer.start()  # only while its chat is in view: another one is not redrawn under the reader

    def save_so_far(self) -> None:
        """At quit: the streaming reply as the user last saw it, marked interrupted. The engine's
        cancelled end would arrive through the event loop, which has stopped by then, and the last
        periodic save is up to ``SAVE_EVERY_S`` behind the screen."""
        if self.reply_id is not None:
            self.save_or_drop(self.text, self.ids, None, interrupted=True)

    def save_or_drop(self, text: str, ids, stats, interrupted: bool) -> None:
        """A reply cut before its first word is not kept: no empty "interrupted" reply in the chat."""
        if interrupted and not text:
            if self.new_version:
                self.store.drop_version(self.reply_id)
            else:
                self.store.delete_message(self.reply_id)
            return
        self.store.update_message(self.reply_id, text, ids, stats, interrupted=interrupted)

    def show_stream(self) -> None:
        """The streaming reply's row, and only it, shows the text so far."""
        if self.reply_id is not None:
            self.win.chat_view.model.set_text(self.reply_id, self.text)

    def on_finished(self, done: dict) -> None:
        cancelled = done["finish_reason"] == "cancelled"
        text = self.text if cancelled else done["text"]
        stats = done["stats"]
        if cancelled and self.loop_stopped:  # a finished reply, not an interrupted one
            stats = {**stats, "finish_reason": "loop"}
        self.save_or_drop(text, done["token_ids"] or self.ids, stats, interrupted=cancelled and not self.loop_stopped)
        self.end()

    def on_failed(self, message: str) -> None:
        if self.reply_id is not None:
            self.store.update_message(self.reply_id, self.text or f"*Error: {message}*", self.ids, interrupted=True)
        self.end()
        self.win.notify(f"error: {message}")

    def end(self) -> None:
        self.reply_id = self.conversation = None
        self.stopping = self.new_version = False
        self.win.clear_notice(STREAMING_NOTICE)
        self.render_timer.stop()
        self._streaming(False)
        self.win.personas.update_badge()
        self.win.render_chat()
        if self.send_after_stop:
            self.send_after_stop = False
            self.send()

    def on_notice(self, kind: str, message: str) -> None:
        if kind in ("warm-up", "eager"):  # eager: the compile failed, so it is over too
            # a compile in the background (the CPU) keeps replies decoding eagerly: nothing waits;
            # a CUDA capture holds the reply for its seconds
            self.warming = kind == "warm-up" and message.startswith("preparing") and "background" not in message
            self.note_warming()

    def note_warming(self) -> None:
        """Under a reply that waits for the decode step to compile, in its own chat: why."""
        if self.reply_id is not None and not self.text and self.conversation == self.win.conversation_id:
            self.win.chat_view.model.set_note(WARMING_NOTE if self.warming else "")
