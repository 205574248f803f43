from __future__ import annotations

from llmlocal.engine.prompt.detokenize import TextStream


def feed_all(stream: TextStream, pieces: list[bytes]) -> list[str]:
    out = [stream.feed(p) for p in pieces]
    out.append(stream.flush())
    return out


def test_multibyte_character_split_across_tokens_is_released_whole() -> None:
    s = TextStream()
    euro = "€".encode()  # 3 bytes
    out = feed_all(s, [b"price ", euro[:1], euro[1:2], euro[2:], b"5"])
    assert out == ["price ", "", "", "€", "5", ""]
    assert s.text == "price €5"


def test_stop_string_spanning_tokens_is_never_shown() -> None:
    s = TextStream(stop=("User:",))
    out = feed_all(s, [b"Sure.", b"\nUs", b"er", b":", b" more"])
    assert "".join(out) == "Sure.\n"
    assert s.stopped and s.text == "Sure.\n"


def test_a_false_start_of_a_stop_string_is_released() -> None:
    s = TextStream(stop=("###",))
    out = feed_all(s, [b"a#", b"#b", b"c"])
    assert out[0] == "a"  # '#' held back: it may begin '###'
    assert "".join(out) == "a##bc" and not s.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    s = TextStream(stop=("END", "\n\n"))
    feed_all(s, [b"one\n\ntwo END"])
    assert s.text == "one"


def test_held_back_text_is_released_at_the_end() -> None:
    s = TextStream(stop=("STOP",))
    out = feed_all(s, [b"ST"])
    assert out == ["", "ST"]
