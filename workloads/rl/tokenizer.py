"""Tokenizers: a real one from `tokenizer.json` (the `tokenizers` package), or the built-in character vocabulary
of the built-in tasks (small, so a tiny model learns it in minutes on a CPU)."""
from __future__ import annotations

from typing import Protocol

BUILTIN_VOCAB = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "-", "*", "=", " ")
EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class UnknownText(ValueError):
    """The text holds characters the vocabulary cannot express."""


class CharTokenizer:
    """One token per character of BUILTIN_VOCAB; prompts start with <bos>."""

    def __init__(self) -> None:
        self.ids = {tok: i for i, tok in enumerate(BUILTIN_VOCAB)}
        self.vocab_size = len(BUILTIN_VOCAB)
        self.eos_id, self.bos_id, self.pad_id = self.ids["<eos>"], self.ids["<bos>"], self.ids["<pad>"]

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.ids})
        if unknown:
            raise UnknownText(f"characters {''.join(unknown)!r} are not in the built-in vocabulary "
                              f"{''.join(BUILTIN_VOCAB[3:])!r}")
        return [self.bos_id] + [self.ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        # <bos> is dropped; any other special or out-of-vocabulary id shows as U+FFFD, so a completion holding
        # one is never mistaken for a well-formed answer.
        return "".join(BUILTIN_VOCAB[i] if 3 <= i < self.vocab_size else "\ufffd"
                       for i in ids if i != self.bos_id)


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.tok = _Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size()
        found = [t for t in EOS_CANDIDATES if self.tok.token_to_id(t) is not None]
        if not found:
            raise ValueError(f"tokenizer {path}: no end-of-sequence token; expected one of {EOS_CANDIDATES}")
        self.eos_id = self.tok.token_to_id(found[0])
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """`builtin` or the path of a tokenizer.json."""
    return CharTokenizer() if spec == "builtin" else HFTokenizer(spec)
