import pytest

from pagedserve.scheduler.api.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    decoder_of,
)

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀 and math ∑∫√",
    "  leading spaces\n\nnew lines\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_breaks_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_fast_decoder_is_the_backends_and_decodes_the_same(tokenizer):
    decode = decoder_of(tokenizer)
    assert decode == tokenizer._tokenizer.decode  # the default model's tokenizer is BPE
    ids = [t for text in TEXTS for t in tokenizer.encode(text)] + [2, 1, 2]
    for skip in (True, False):
        for end in range(0, len(ids), 7):
            assert decode(ids[:end], skip_special_tokens=skip) == tokenizer.decode(
                ids[:end], skip_special_tokens=skip)


class _WordPiece:  # a tokenizer whose wrapper's clean-up pass changes text
    class _tokenizer:  # noqa: N801
        class model:  # noqa: N801
            pass

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "raw"

    clean_up_tokenization_spaces = True

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "cleaned"


def test_wrapper_kept_where_it_cleans_up():
    assert decoder_of(_WordPiece)([1]) == "cleaned"


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji across tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🎉"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi") + [2]  # 2 = <|im_end|>
    skip = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(skip.push(t) for t in ids) == "Hi"
    assert "".join(keep.push(t) for t in ids) == "Hi<|im_end|>"


def test_stop_string_is_cut_and_partial_match_held_back():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abc S", final=False) == ("abc ", None)  # "S" might start STOP: held
    assert m.feed("T", final=False) == ("", None)
    assert m.feed("OPxyz", final=False) == ("", "STOP")


def test_false_alarm_is_released():
    m = StopStringMatcher(("STOP",))
    assert m.feed("ST", final=False) == ("", None)
    assert m.feed("ay", final=False) == ("STay", None)
    assert m.feed("", final=True) == ("", None)


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(("world", "lo"))
    assert m.feed("hello world", final=False) == ("hel", "lo")


def test_no_stops_passes_everything():
    m = StopStringMatcher(())
    assert m.feed("abc", final=False) == ("abc", None)
