import pytest

TEXTS = [
    "The capital of France is",
    "Numbers 12345 and 3.14159, dates 2026-11-30!",
    "  leading spaces, tabs\tand\nnewlines",
    "Unicode: naïve café, 日本語, emoji 🚀",
    "<|im_start|>user\nHello<|im_end|>",
]


@pytest.mark.oracle
@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer):
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.vocab_size == 49152


@pytest.mark.oracle
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ours = tokenizer.render_chat(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
