"""Streaming detokenization and stop strings: text is emitted only when it is final."""


class StreamDetokenizer:
    """Decodes a growing list of ids; a multi-byte character split across tokens is held back until
    complete, so the stream never carries a broken UTF-8 character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # decoding from one step back keeps leading-space rules right
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class StopChecker:
    """Finds stop strings in the stream and holds back text that might be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                self.stopped = True
                out, self.pending = self.pending[:at], ""
                return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
