"""Incremental detokenization: UTF-8 safety, spaces, stop strings and held-back text."""
import pytest

from engine.detokenizer import IncrementalDetokenizer, TokenBytes
from engine.sampling_params import SamplingParams

TEXTS = [
    "Hello world, 你好世界! 🎉🎊 café naïve résumé",
    "日本語のテキストと中文混合，还有한국어도 있습니다。",
    "emoji: 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ❤️‍🔥 — and   runs   of    spaces\n\n\tand tabs",
    "  leading spaces and trailing   ",
    "Ångström, Straße, Øresund, Ñandú, ĳ, ﬁ ligature, Zürich",
    "math: ∑ᵢ xᵢ² ≤ ∞, ∀x∈ℝ; arrows ← ↑ → ↓; box ┌─┐",
]


def stream(tokenizer, ids, params=None, prompt=(1, 2)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas, stop = [], None
    for token_id in ids:
        stop = detok.step(token_id)
        deltas.append(detok.pop_delta(finished=stop is not None))
        if stop is not None:
            break
    else:
        deltas.append(detok.pop_delta(finished=True))
    return deltas, stop, detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode_and_never_hold_a_replacement_char(tokenizer, text):
    ids = tokenizer(text).input_ids
    deltas, _, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # multi-byte characters really do span tokens here: some steps emit nothing
    if any(ord(c) > 0x2000 for c in text):
        assert "" in deltas[:-1]


def test_real_generations(tokenizer, llm):
    from engine import SamplingParams as Params

    prompts = ["Write a short poem with emoji about the moon.", "Translate 'good morning' into Chinese and Japanese.",
               "List three French words with accents."]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                       Params(temperature=0.7, seed=7, max_tokens=48), use_tqdm=False)
    for output in outputs:
        ids = output.outputs[0].token_ids
        deltas, _, _ = stream(tokenizer, ids, prompt=output.prompt_token_ids)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        if not expected.endswith("\ufffd"):  # a generation may stop mid-character
            assert "".join(deltas) == expected == output.outputs[0].text
        assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_tokens_is_caught_and_cut(tokenizer):
    text = "The answer is forty-two. Goodbye"
    ids = tokenizer(text).input_ids
    stop = "forty-two"
    assert len(tokenizer(" " + stop).input_ids) >= 2  # spans several tokens
    deltas, matched, detok = stream(tokenizer, ids, SamplingParams(stop=[stop]))
    assert matched == stop
    assert "".join(deltas) == detok.output_text == "The answer is "
    deltas, _, _ = stream(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert "".join(deltas) == "The answer is forty-two"


def test_no_stop_string_ends_the_output_within_min_tokens(tokenizer):
    # vLLM V1's: a trial's stop " " after "The capital of France is" ended at once despite min_tokens 5
    ids = tokenizer(" Paris, the city of light").input_ids
    assert len(ids) >= 6
    _, matched, detok = stream(tokenizer, ids, SamplingParams(stop=[" "], min_tokens=5, max_tokens=16))
    assert [tokenizer.decode([i]) for i in ids[4:6]] == [" of", " light"]
    assert matched == " " and detok.output_text == " Paris, the city of"  # the 6th token's space
    _, matched, detok = stream(tokenizer, ids, SamplingParams(stop=[" "]))
    assert matched == " " and detok.output_text == ""  # without min_tokens: the first token's space
    # a stop string that starts within min_tokens and ends after them counts
    ids = tokenizer("The answer is forty-two. Goodbye").input_ids
    count = len(tokenizer("The answer is forty").input_ids)
    _, matched, detok = stream(tokenizer, ids, SamplingParams(stop=["forty-two"], min_tokens=count, max_tokens=16))
    assert matched == "forty-two" and detok.output_text == "The answer is "


def test_text_that_may_start_a_stop_string_is_held_back_then_released(tokenizer):
    ids = tokenizer("Count: 1, 2, 3").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["3, 4"]))
    emitted = ""
    for token_id in ids:
        assert detok.step(token_id) is None
        emitted += detok.pop_delta(finished=False)
    assert emitted == "Count: 1, 2, "  # "3" could still grow into "3, 4"
    assert detok.pop_delta(finished=True) == "3"  # max_tokens ended it: release


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("alpha beta gamma delta").input_ids
    _, matched, detok = stream(tokenizer, ids, SamplingParams(stop=["delta", "beta", "gamma delta"]))
    assert matched == "beta" and detok.output_text == "alpha "


def test_stop_matcher_finds_overlapping_and_repeated_prefixes():
    from engine.detokenizer import StopMatcher

    matcher = StopMatcher("abab")
    hits = [i for i, c in enumerate("aabababx") if matcher.feed(c)]
    assert hits == [4, 6]  # "aabab" and "aababab" end with "abab"
    matcher = StopMatcher("aab")
    assert [matcher.feed(c) for c in "aaab"] == [False, False, False, True]
    matcher = StopMatcher("xyz")
    for c in "wxy":
        matcher.feed(c)
    assert matcher.matched == 2


def test_long_stop_strings_hold_back_only_their_matched_prefix(tokenizer):
    stops = [("ab" * 5000) + str(i) for i in range(16)]  # 16 stop strings of 10k characters
    ids = tokenizer("ab" * 3000).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=stops))
    emitted = "".join(detok.pop_delta(finished=False) for _ in map(detok.step, ids))
    assert emitted == ""  # all of "abab..." could still become a stop string
    assert detok.pop_delta(finished=True) == "ab" * 3000


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_utf8_of_the_text(tokenizer, text):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert b"".join(token_bytes(i) for i in ids) == text.encode("utf-8")
    if any(ord(c) > 0x7FF for c in text):  # some token holds part of a character
        assert any(tokenizer.decode([i]) == "\ufffd" and token_bytes(i) != "\ufffd".encode() for i in ids)


def test_token_bytes_of_special_tokens_are_their_text(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(tokenizer.eos_token_id) == tokenizer.eos_token.encode()


def test_token_bytes_of_a_sentencepiece_tokenizer_with_byte_fallback():
    """Llama 2 / Mistral style: "▁" for a space, ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁cat": 1, "▁": 2, "<0xF0>": 3, "<0x9F>": 4, "<0x90>": 5, "<0xB1>": 6, "s": 7}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    token_bytes = TokenBytes(tokenizer)
    ids = [1, 7, 2, 3, 4, 5, 6]  # " cats 🐱"
    assert b"".join(token_bytes(i) for i in ids) == " cats 🐱".encode()
    assert [token_bytes(i) for i in (3, 1)] == [b"\xf0", b" cat"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_cut_inside_a_character_is_not_repeated_in_the_output(tokenizer, text):
    """A trial: the prompt [26843, 40303] ("Hi" and the first three bytes of an emoji) began
    its completion with "Hi ", the prompt's text (tokenizers' DecodeStream repeats a context
    that ends in U+FFFD). Each cut inside a character: the output is the text after the
    prompt's whole characters, the one the cut split included."""
    ids = tokenizer(text).input_ids
    full = tokenizer.decode(ids)
    for cut in range(1, len(ids)):
        prompt = tokenizer.decode(ids[:cut])
        if not prompt.endswith("\ufffd") or "\ufffd" in tokenizer.decode(ids[cut:cut + 4]):
            continue  # the cut is between characters, or the output starts inside another
        deltas, _, _ = stream(tokenizer, ids[cut:], prompt=ids[:cut])
        assert "".join(deltas) == full[len(prompt) - 1:], (cut, prompt)
    deltas, _, _ = stream(tokenizer, [221, 10813, 230, 126], prompt=[26843, 40303])  # completes 😃, then 🌱
    assert "".join(deltas) == "😃🌱"
    # a U+FFFD the next token does not complete stays the prompt's
    deltas, _, _ = stream(tokenizer, tokenizer(" ok", add_special_tokens=False).input_ids, prompt=[26843, 40303])
    assert "".join(deltas) == " ok"
    # a prompt that ends in the character U+FFFD itself is not repeated either
    literal = tokenizer("Hi \ufffd", add_special_tokens=False).input_ids
    deltas, _, _ = stream(tokenizer, tokenizer(" ok", add_special_tokens=False).input_ids, prompt=literal)
    assert "".join(deltas) == " ok"
