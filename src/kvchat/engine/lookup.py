"""Tokens proposed from the conversation itself (prompt lookup decoding): where the last few tokens
of a reply occurred before (in the prompt, an earlier turn, the reply so far, or a prediction the
API client sent), the tokens that followed them then are proposed to come next now. The model then
checks them all in one forward pass (``speculation``) and keeps the ones it would have chosen.

An index from each n-gram (``MIN_NGRAM`` .. ``MAX_NGRAM`` tokens) to where it first and last ended,
filled as the tokens come: a lookup is a few dict reads, not a scan of the context. The latest
occurrence is the likelier to go on as now, but in a run that repeats (a list, a loop a model fell
into) it ends just before the suffix itself, with a token or two after it; the first occurrence is
then followed by the run itself."""
MIN_NGRAM, MAX_NGRAM = 3, 4


class NgramIndex:
    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        self.ends: dict[tuple, int] = {}  # n-gram -> the position just after its latest occurrence
        self.firsts: dict[tuple, int] = {}  # and after its first
        self.extend(tokens or [])

    def extend(self, tokens) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                gram = tuple(self.tokens[end - n:end])
                self.ends[gram] = end
                self.firsts.setdefault(gram, end)

    def follow(self, suffix: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``suffix`` where it last
        occurred, or first, where fewer than ``k`` followed the last."""
        for n in range(min(MAX_NGRAM, len(suffix)), MIN_NGRAM - 1, -1):
            gram = tuple(suffix[-n:])
            end = self.ends.get(gram)
            if end is not None:
                found = self.tokens[end:end + k]
                first = self.firsts[gram]
                return found if len(found) == k else max(found, self.tokens[first:first + k], key=len)
        return []


class Lookup:
    """The proposals of one reply: from the client's prediction first (OpenAI's Predicted
    Outputs: a reply starts as its prediction does), else from the sequence's own tokens, the
    prompt and the reply so far."""

    def __init__(self, prediction: list[int] | None = None):
        self.prediction = NgramIndex(prediction) if prediction else None
        self.own = NgramIndex()
        self.on_track = 0  # the reply's first tokens known to be the prediction's (None: it left it)

    def propose(self, token_ids: list[int], generated: int, k: int) -> list[int]:
        # all but the last token: the live suffix must match an earlier occurrence, not itself
        self.own.extend(token_ids[len(self.own.tokens):len(token_ids) - 1])
        if self.prediction is not None:
            predicted = self.prediction.tokens
            if self._follows(predicted, token_ids, generated) and generated < len(predicted):
                return predicted[generated:generated + k]  # the reply so far is the prediction's start
            found = self.prediction.follow(token_ids[-MAX_NGRAM:], k)
            if found:
                return found
        return self.own.follow(token_ids[-MAX_NGRAM:], k)

    def _follows(self, predicted: list[int], token_ids: list[int], generated: int) -> bool:
        """Is the reply so far the prediction's start? Only its tokens since the last call are
        compared: a step does not compare the whole reply again."""
        if self.on_track is None:
            return False
        reply = token_ids[len(token_ids) - generated:]
        if reply[self.on_track:] != predicted[self.on_track:generated]:
            self.on_track = None
            return False
        self.on_track = generated
        return True
