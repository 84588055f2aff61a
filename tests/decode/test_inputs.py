"""The decoding calls take a list of str: one string, a non-string or a lone surrogate
is refused naming the line (or prompt) by its number."""

import pytest

from transduce.decode.inputs import TextError, checked_texts


def test_a_list_of_text_passes_as_a_list():
    assert checked_texts(("uno", "", "ñandú 🐦")) == ["uno", "", "ñandú 🐦"]


@pytest.mark.parametrize("texts,message", [
    ("Jesús lloró.", r"^expected a list of lines, got one str: pass \[text\]"),
    (b"hola", r"^expected a list of lines, got one bytes"),
    (["uno", 3], r"^line 2: a int \(3\), not a str$"),
    (["uno", None], r"^line 2: a NoneType \(None\), not a str$"),
    (["uno", b"dos"], r"^line 2: a bytes \(b'dos'\), not a str$"),
    (["uno", "do\ud800s"], r"^line 2: a lone surrogate at character 3 \('\\ud800'\)"),
])
def test_what_is_not_a_list_of_text_is_named(texts, message):
    with pytest.raises(TextError, match=message):
        checked_texts(texts)


def test_prompts_are_counted_from_the_first_number():
    with pytest.raises(TextError, match=r"^prompt 12: a int"):
        checked_texts(["a", 1], "prompt", first_number=11)
