"""The tokenizer carried inside a GGUF file (GPT-2 style byte-level BPE), built with `tokenizers`.

`GGUFTokenizer.from_gguf(path)` reads the vocabulary, merges, special-token ids and chat template
from the file's `tokenizer.*` metadata; `load_tokenizer(source)` finds the one a model source
carries. Control tokens (`<|im_start|>`, ...) encode as single ids. The pre-tokenizer follows
llama.cpp's `pre` name: `smollm` splits digits one by one before the GPT-2 byte-level regex;
`gpt2`-style files use the byte-level regex alone. The built tokenizer is kept in the model cache
(`conversion_cache`, as the `tokenizers` JSON), which later processes read instead of the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_CONTROL_TOKEN_TYPE = 3
_DIGIT_SPLITTING_PRE = {"smollm"}


class GGUFTokenizer:
    def __init__(self, tokenizer, eos_token_id: int | None, bos_token_id: int | None,
                 chat_template: str | None, vocab_size: int):
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.vocab_size = vocab_size

    @classmethod
    def from_gguf(cls, path: str | Path) -> GGUFTokenizer:
        """The file's tokenizer, from the model cache (`conversion_cache`) after the first time."""
        from rekv_core.model.conversion_cache import cached, code_version

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        made_by = code_version((sys.modules[__name__],), ("gguf", "tokenizers"))
        return cached(path, "tokenizer", ".json", lambda: cls._convert(path),
                      lambda tokenizer, entry: entry.write_text(tokenizer.to_json()),
                      lambda entry: cls.from_json(entry.read_text()), made_by)

    def to_json(self) -> str:
        return json.dumps({"tokenizer": self._tokenizer.to_str(), "eos_token_id": self.eos_token_id,
                           "bos_token_id": self.bos_token_id, "chat_template": self.chat_template,
                           "vocab_size": self.vocab_size})

    @classmethod
    def from_json(cls, text: str) -> GGUFTokenizer:
        from tokenizers import Tokenizer

        fields = json.loads(text)
        return cls(Tokenizer.from_str(fields.pop("tokenizer")), **fields)

    @classmethod
    def _convert(cls, path: Path) -> GGUFTokenizer:
        import gguf
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        fields = gguf.GGUFReader(str(path)).fields

        def get(key: str, default=None):
            return fields[key].contents() if key in fields else default

        model_kind = get("tokenizer.ggml.model")
        if model_kind != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: only byte-level BPE ('gpt2') is supported, "
                             f"got {model_kind!r}")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        tokenizer = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if get("tokenizer.ggml.pre") in _DIGIT_SPLITTING_PRE:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        token_types = get("tokenizer.ggml.token_type", [])
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True)
                                      for i, kind in enumerate(token_types)
                                      if kind == _CONTROL_TOKEN_TYPE])
        return cls(tokenizer, eos_token_id=get("tokenizer.ggml.eos_token_id"),
                   bos_token_id=get("tokenizer.ggml.bos_token_id"),
                   chat_template=get("tokenizer.chat_template"), vocab_size=len(tokens))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Apply the file's Jinja chat template to `[{"role": ..., "content": ...}]`."""
        if not self.chat_template:
            raise ValueError("chat_template: this GGUF file carries no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True
                                                 ).from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


EMBEDDED_TOKENIZER = "embedded"  # the embedded model's tokenizer, whatever the weights


def load_tokenizer(source: str) -> GGUFTokenizer | None:
    """The tokenizer of a model source (see `weights.load_weights`), or of `embedded`: the
    embedded model's for it and `embedded`, a GGUF file's own; None for synthetic weights and
    checkpoint directories, which are served by token ids."""
    from rekv_core.model.shapes import DEFAULT_MODEL
    from rekv_core.model.weights import embedded_gguf_path

    if source in (DEFAULT_MODEL, EMBEDDED_TOKENIZER):
        return GGUFTokenizer.from_gguf(embedded_gguf_path())
    if source.endswith(".gguf"):
        return GGUFTokenizer.from_gguf(source)
    return None
