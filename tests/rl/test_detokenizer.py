"""Incremental detokenization on a real byte-level BPE tokenizer: characters split over several byte tokens are
released whole, stop strings cut the text (held back from a stream until they cannot begin one)."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_rl_eks.workloads.rollout.detokenizer import CompletionText


class ByteLevel:
    """A byte-level BPE of 256 byte tokens and a few merges (the `tokenizers` library's own model)."""

    def __init__(self) -> None:
        self.tok = Tokenizer(models.BPE())
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        self.tok.train_from_iterator(["the cat sat on the mat"], trainer)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


@pytest.fixture(scope="module")
def tok():
    return ByteLevel()


def test_multibyte_characters_come_out_whole_and_the_text_is_exact(tok):
    text = "the 😀 cat é€ sat"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji and accents are several byte tokens each
    out = CompletionText(tok)
    for token in ids:
        out.add(token)
        assert "\ufffd" not in out.text  # nothing half-decoded is ever released
    out.finish()
    assert out.text == text and out.stopped_by is None


def test_a_stop_string_cuts_the_text_and_a_stream_never_shows_its_start(tok):
    ids = tok.encode("the cat😀 sat on the mat")
    out = CompletionText(tok, stops=["😀 s", "zzz"])
    streamed = ""
    for token in ids:
        out.add(token)
        streamed += out.take()
        assert "😀" not in streamed  # held back while it may begin the stop string
    assert out.text == "the cat" and out.stopped_by == "😀 s"
    assert tok.decode(ids[:out.kept_tokens]).startswith("the cat😀 s")  # cut at the token that completed it
    assert "😀 s" not in tok.decode(ids[:out.kept_tokens - 1])
    assert streamed + out.take(final=True) == "the cat"
