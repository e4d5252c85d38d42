"""Tokenizers: stop ids from a checkpoint's files, chat templates rendered as transformers renders them, round
trips, the built-in character vocabulary, and errors that name the file and field."""
import json

import pytest

from moe_rl_eks.tools.example_data import SPECIAL_TOKENS, write_tokenizer_dir
from moe_rl_eks.workloads.rl.tokenizer import (CharTokenizer, TokenizerError, UnknownText, load_model_tokenizer,
                                               load_tokenizer)

TEXTS = ["Ann has 3 apples and finds 2 more. How many apples does Ann have?", "Answer with the number only.",
         "Ben fills 4 bags with 2 coins each."] * 20
MESSAGES = [{"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": "Ann has 3 apples and finds 2 more. How many apples does Ann have?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer_dir(directory, TEXTS, vocab_size=300)
    return directory


def test_eos_ids_are_every_eos_the_checkpoint_lists_turn_end_first(model_dir):
    tok = load_tokenizer(str(model_dir))
    im_end, end_of_text = tok.tok.token_to_id("<|im_end|>"), tok.tok.token_to_id("<|endoftext|>")
    assert tok.eos_ids == (im_end, end_of_text) and tok.eos_id == im_end
    assert tok.bos_id is None


def test_qwen3_layout_stops_on_im_end_151645_and_endoftext_151643(tmp_path):
    """The bug of the issue: the first EOS candidate present (<|endoftext|>) was the only stop id."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(151643)}
    vocab.update({"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645})
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_id == 151645 and tok.eos_ids == (151645, 151643)


def test_chat_template_renders_and_tokenizes_as_transformers_does(model_dir):
    from transformers import AutoTokenizer

    ours, theirs = load_model_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        text = ours.apply_chat_template(MESSAGES, **kwargs)
        assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        expected = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, **kwargs)
        assert ours.encode(text) == list(getattr(expected, "input_ids", expected))
    no_think = ours.apply_chat_template(MESSAGES, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")
    assert not ours.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_special_tokens_encode_as_one_id_and_decode_drops_them(model_dir):
    tok = load_model_tokenizer(model_dir)
    text = "Ann has 3 apples and finds 2 more."
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>user\n5<|im_end|>")
    assert ids[0] == tok.tok.token_to_id("<|im_start|>") and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "user\n5"
    assert len(SPECIAL_TOKENS) == sum(tok.tok.token_to_id(t) is not None for t in SPECIAL_TOKENS)


def test_template_in_its_own_file_wins_and_raise_exception_surfaces(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}")
    tok = load_model_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[user]"é"'
    with pytest.raises(Exception, match="first message must be the user"):
        tok.apply_chat_template(MESSAGES)


def test_bare_tokenizer_json_stops_on_every_known_eos_it_holds(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "two": 2, "plus": 3, "is": 4, "four": 5, "<|im_end|>": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.eos_ids == (1, 6) and loaded.eos_id == 1 and loaded.vocab_size == 7
    assert loaded.encode("two plus two is") == [2, 3, 2, 4]
    assert loaded.decode([5, 1]) == "four"
    (tmp_path / "bare.json").write_text((tmp_path / "tokenizer.json").read_text()
                                        .replace("</s>", "<x>").replace("<|im_end|>", "<y>"))
    with pytest.raises(TokenizerError, match="no end-of-sequence token"):
        load_tokenizer(str(tmp_path / "bare.json"))
    with pytest.raises(TokenizerError, match="no chat template"):
        loaded.apply_chat_template(MESSAGES)


def test_bad_checkpoint_files_name_the_file_and_field(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(TokenizerError, match=r"generation_config.json: eos_token_id: \[1000000\]"):
        load_model_tokenizer(tmp_path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json: eos_token: '<|nope|>'"):
        load_model_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_model_tokenizer(tmp_path / "missing")


def test_builtin_tokenizer_round_trip_unknown_characters_and_no_chat():
    tok = CharTokenizer()
    ids = tok.encode("12+3=")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "12+3=" and tok.eos_ids == (tok.eos_id,)
    # a special or out-of-vocabulary id inside a completion must not read as a well-formed answer
    assert tok.decode([tok.ids["7"], tok.eos_id, 30]) == "7\ufffd\ufffd"
    with pytest.raises(UnknownText, match="'x'"):
        tok.encode("x+1=")
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
