"""A terminal conversation: the message list, the persona, and the slash commands of ``kvchat chat``."""
from kvchat.core.config import SamplingParams
from kvchat.core.events import EngineError, Request
from kvchat.remote.metrics import ServerMemory


class ChatSession:
    def __init__(self, engine, system: str | None = None):
        self.engine, self.system = engine, system
        self.messages: list[dict] = []
        self.last_stats = None
        self.server_memory = None  # a remote server's own figures, as it last reported them
        engine.add_listener(self._on_event)

    def _on_event(self, event) -> None:
        if isinstance(event, ServerMemory):  # only a remote backend sends it
            self.server_memory = event

    def conversation(self) -> list[dict]:
        persona = [{"role": "system", "content": self.system}] if self.system else []
        return persona + self.messages

    def command(self, line: str, sampling: SamplingParams, stream, say) -> bool:
        """Handle one input line; False means quit."""
        text = line.strip()
        if text in ("/quit", "/exit"):
            return False
        if text.startswith("/system"):
            self.system = text[len("/system"):].strip() or None
            self.messages = []
            say(f"[persona {'set' if self.system else 'cleared'}; conversation reset]")
        elif text == "/reset":
            self.messages = []
            say("[conversation reset]")
        elif text == "/stats":
            say(self.stats_line())
        elif text.startswith("/"):
            say("[commands: /system TEXT, /reset, /stats, /quit]")
        elif text:
            self.send(text, sampling, stream, say)
        return True

    def send(self, text: str, sampling: SamplingParams, stream, say) -> None:
        self.messages.append({"role": "user", "content": text})
        try:
            done = self._reply(self.engine.submit(Request(messages=self.conversation(), sampling=sampling)), stream, say)
        except EngineError as e:
            self.messages.pop()
            say(f"[error: {e}]")
            return
        self.messages.append({"role": "assistant", "content": done.text, "token_ids": done.token_ids})
        self.last_stats = done.stats

    def _reply(self, handle, stream, say):
        try:
            return stream(handle)
        except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat; what came so far is kept
            handle.cancel()  # local or remote, the request ends with a cancelled Finished
            done = handle.result()
            say("\n[stopped]")
            return done

    def stats_line(self) -> str:
        line = format_stats(self.last_stats) if self.last_stats else "[no turn yet]"
        return line + (f"\n[{self.server_memory.line()}]" if self.server_memory is not None else "")


def format_stats(stats) -> str:
    cached = (f"{stats.cached_tokens} cached, {stats.computed_tokens} computed"
              if getattr(stats, "cached_reported", True) else "cached: not reported")  # a remote server may not say
    return (f"prompt {stats.prompt_tokens} tokens ({cached}), "
            f"generated {stats.generated_tokens}, TTFT {stats.ttft_ms:.0f} ms, {stats.decode_tok_s:.1f} tok/s, "
            f"KV {stats.kv_precision}"
            + (f", {stats.trimmed_messages} oldest message(s) outside the context" if stats.trimmed_messages else "")
            + _speculation(stats))


def _speculation(stats) -> str:
    kept, dropped = getattr(stats, "accepted_prediction_tokens", 0), getattr(stats, "rejected_prediction_tokens", 0)
    return f", {kept} of {kept + dropped} proposed tokens kept" if kept + dropped else ""
