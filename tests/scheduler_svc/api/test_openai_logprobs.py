"""Token ids as the OpenAI API's logprobs show them, with the served model's tokenizer."""

from __future__ import annotations

from pagedserve.scheduler.api.openai_logprobs import TokenText, completion_logprobs, prompt_logprobs
from pagedserve.scheduler.outputs import TokenLogprob


def test_a_token_that_is_part_of_a_character_keeps_its_own_bytes(tokenizer):
    tt = TokenText(tokenizer)
    euro = tokenizer.encode("€")  # three UTF-8 bytes; byte-level BPE may split them
    assert b"".join(bytes(tt.bytes(t)) for t in euro) == "€".encode()
    lone = tokenizer.convert_tokens_to_ids("â")  # the byte 0xE2 alone: not a character
    assert tt.bytes(lone) == [0xE2] and tt.text(lone) == "\ufffd"
    hello = tokenizer.encode(" Hello")
    assert [tt.text(t) for t in hello] == [" Hello"] and tt.bytes(hello[0]) == list(b" Hello")


def test_completion_offsets_and_prompt_logprobs_layout(tokenizer):
    tt = TokenText(tokenizer)
    a, b = tokenizer.encode(" Hello")[0], tokenizer.encode(" world")[0]
    out, end = completion_logprobs(tt, [a, b], [TokenLogprob(-0.5, (b,), (-0.25,)),
                                                TokenLogprob(-1.0, (b,), (-1.0,))], 3)
    assert out == {"tokens": [" Hello", " world"], "token_logprobs": [-0.5, -1.0],
                   "top_logprobs": [{" world": -0.25, " Hello": -0.5}, {" world": -1.0}],
                   "text_offset": [3, 9]}
    assert end == 15
    assert prompt_logprobs(tt, [a, b], [None, TokenLogprob(-2.0, (a, b), (-0.5, -2.0), 2)]) == [
        None, {str(b): {"logprob": -2.0, "rank": 2, "decoded_token": " world"},
               str(a): {"logprob": -0.5, "rank": 1, "decoded_token": " Hello"}}]


def test_an_echoed_prompt_comes_first_unscored_then_k_alternatives(tokenizer):
    """echo: the prompt's entries (the first null, as OpenAI's), computed with more
    alternatives than the request's logprobs shows, then the completion's after them."""
    tt = TokenText(tokenizer)
    a, b = tokenizer.encode(" Hello")[0], tokenizer.encode(" world")[0]
    prompt, end = completion_logprobs(
        tt, [a, b], [None, TokenLogprob(-2.0, (a, b), (-0.5, -2.0), 2)], 0, k=1)
    assert end == 12
    out, end = completion_logprobs(tt, [a], [TokenLogprob(-0.1, (a,), (-0.1,))], end,
                                   into=prompt)
    assert out is prompt and end == 18
    assert out == {"tokens": [" Hello", " world", " Hello"],
                   "token_logprobs": [None, -2.0, -0.1],
                   "top_logprobs": [None, {" Hello": -0.5, " world": -2.0}, {" Hello": -0.1}],
                   "text_offset": [0, 6, 12]}
    assert prompt_logprobs(tt, [a, b], [None, TokenLogprob(-2.0, (a, b), (-0.5, -2.0), 2)],
                           k=0) == [None, {str(b): {"logprob": -2.0, "rank": 2,
                                                    "decoded_token": " world"}}]
