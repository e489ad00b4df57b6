from kvchat.engine.detok import StopChecker, StreamDetokenizer


def test_stream_never_emits_a_broken_character_and_adds_up(tokenizer):
    text = "Café 🙂 naïve 日本語 — done 👍🏽!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 3  # multi-byte characters really are split across tokens here
    d = StreamDetokenizer(tokenizer)
    pieces = [d.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_split_across_pieces_is_held_back_and_cut():
    s = StopChecker(["</answer>"])
    out = [s.feed("The result is 4</"), s.feed("ans"), s.feed("wer> trailing")]
    assert out == ["The result is 4", "", ""]
    assert s.stopped


def test_false_alarm_is_released():
    s = StopChecker(["STOP"])
    assert s.feed("ST") == ""
    assert s.feed("ART") == "START"
    assert s.feed("S") == ""
    assert s.flush() == "S"
    assert not s.stopped
