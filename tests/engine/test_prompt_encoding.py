"""Prompt encoding is linear in the conversation: one render per new message and one to check,
the same tokens as rendering prefix by prefix, and a trim that re-encodes once."""
import pytest

import random

from kvchat.engine.chat import ChatFormatter, Stopped
from kvchat.engine.prompt import drop_long, drop_to_fit


def conversation(n: int, tokenizer=None) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(n):
        messages.append({"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"})
        reply = {"role": "assistant", "content": f"It is {2 * i}."}
        if tokenizer is not None and i % 2:
            reply["token_ids"] = tokenizer(reply["content"], add_special_tokens=False)["input_ids"]
        messages.append(reply)
    return messages + [{"role": "user", "content": "And now?"}]


class Counting(ChatFormatter):
    renders = 0

    def render(self, messages, add_generation_prompt=False):
        self.renders += 1
        return super().render(messages, add_generation_prompt)


@pytest.mark.parametrize("persona", [True, False])
def test_pairwise_pieces_equal_prefix_by_prefix_rendering(tokenizer, persona):
    messages = conversation(12, tokenizer)[0 if persona else 1:]
    f = ChatFormatter(tokenizer)
    fast = f.encode(messages)
    assert f._by_pairs(messages, True, lambda: False) is not None  # the starter's template composes pairwise
    slow = f._by_prefixes(messages, True, lambda: False)
    assert fast.token_ids == [t for piece in slow for t in piece]
    assert fast.message_starts == [sum(map(len, slow[:i])) for i in range(len(messages))]


def test_a_new_turn_of_a_long_chat_costs_a_few_renders_not_one_per_message(tokenizer):
    f = Counting(tokenizer)
    messages = conversation(100)
    f.encode(messages[:-2])
    f.renders = 0
    f.encode(messages)
    assert f.renders <= 8  # the two new messages' pairs, the generation prompt, the check; not ~200


def test_a_template_that_does_not_compose_pairwise_falls_back_to_prefixes(tokenizer):
    f = ChatFormatter(tokenizer)
    # numbers each message: a message's text depends on where it is, not only on the one before
    f.template = ("{% for m in messages %}{{ loop.index }}:{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = conversation(3)
    assert f._by_pairs(messages, True, lambda: False) is None
    text = tokenizer.decode(f.encode(messages).token_ids)
    assert text == f.render(messages, add_generation_prompt=True)


def test_trimming_drops_enough_messages_in_one_go(tokenizer):
    f = Counting(tokenizer)
    messages = conversation(60)
    encoded = f.encode(messages)
    budget = len(encoded.token_ids) // 3
    shorter = drop_to_fit(messages, encoded, budget)
    assert shorter[0] == messages[0] and shorter[-1] == messages[-1] and shorter[1]["role"] == "user"
    assert len(f.encode(shorter).token_ids) <= budget
    kept_from = len(messages) - (len(shorter) - 1)
    one_more = messages[:1] + messages[kept_from - 2:]  # the last exchange it dropped, back
    assert len(f.encode(one_more).token_ids) > budget


def test_the_segment_cache_is_capped_in_bytes_and_answers_the_same(tokenizer):
    """Distinct long messages, as an API client can send: the cache stays under its byte cap, and a
    message evicted from it encodes to the same tokens as before."""
    capped = ChatFormatter(tokenizer, cache_bytes=2 << 20)
    texts = [f"message {i}: " + "lorem ipsum dolor sit amet " * 1000 for i in range(40)]  # ~27 KB each
    first = [capped.encode([{"role": "user", "content": t}]).token_ids for t in texts]
    assert capped.cached_bytes <= 2 << 20 and 1 < len(capped._segments) < 40
    assert capped.encode([{"role": "user", "content": texts[0]}]).token_ids == first[0]
    assert first[0] == ChatFormatter(tokenizer).encode([{"role": "user", "content": texts[0]}]).token_ids


def test_a_prompt_is_refused_on_its_characters_when_they_alone_exceed_the_context(tokenizer):
    from kvchat.engine.chat import ChatError

    formatter = ChatFormatter(tokenizer)
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert formatter.max_chars(100) == 100 * longest
    with pytest.raises(ChatError, match="characters, longer than the context of 100 tokens"):
        formatter.prompt_ids("a" * (100 * longest + 1), 100)
    with pytest.raises(ChatError, match="tokens, longer than the context of 100"):
        formatter.prompt_ids("a b " * 100, 100)  # under the character bound, over in tokens
    assert formatter.prompt_ids("Hello", 100) == tokenizer("Hello")["input_ids"]


def reference_drop_oldest(messages):
    """The trim's rule, one exchange at a time (the engine's former loop, quadratic in the count):
    the oldest message after the persona goes, then the history starts again on a user turn."""
    head = 1 if messages[0]["role"] == "system" else 0
    if len(messages) - head <= 1:
        return None
    rest = messages[head + 1:]
    while len(rest) > 1 and rest[0]["role"] != "user":
        rest = rest[1:]
    return messages[:head] + rest


class Sized:
    """An encoding whose message sizes are given (what drop_to_fit reads of one)."""

    def __init__(self, sizes, generation_prompt):
        self.message_starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.prompt_start = sum(sizes)
        self.token_ids = [0] * (self.prompt_start + generation_prompt)


def random_chat(rng, n):
    messages = [{"role": "system", "content": "p" * rng.randint(1, 9)}] if rng.random() < 0.5 else []
    roles = ["user", "assistant"]
    for _ in range(n):
        messages.append({"role": rng.choice(roles + ["user"]), "content": "x" * rng.randint(1, 30)})
    messages.append({"role": "user", "content": "y" * rng.randint(1, 30)})
    return messages


def test_the_one_pass_trims_keep_what_dropping_one_exchange_at_a_time_kept():
    rng = random.Random(0)
    for case in range(400):
        messages = random_chat(rng, rng.randint(0, 12))
        cap = rng.randint(1, 32)
        want = messages
        while want is not None and max(len(m["content"]) for m in want) > cap:
            want = reference_drop_oldest(want)
        assert drop_long(messages, cap) == want, case
        sizes = [len(m["content"]) for m in messages]
        encoded, budget = Sized(sizes, 3), rng.randint(1, sum(sizes) + 3)
        want = reference_drop_oldest(messages)
        while want is not None and sum(len(m["content"]) for m in want) + 3 > budget:
            fewer = reference_drop_oldest(want)
            if fewer is None:
                break
            want = fewer
        assert drop_to_fit(messages, encoded, budget) == want, case


def test_encoding_stops_between_messages_when_asked(tokenizer):
    f = Counting(tokenizer)
    messages = conversation(40)
    asked = []
    with pytest.raises(Stopped):
        f.encode(messages, stop=lambda: asked.append(1) or len(asked) > 5)
    assert len(asked) == 6 and f.renders <= 12  # stopped at the sixth message, not after all 82
