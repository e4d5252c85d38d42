"""Tokenizers: a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json` with its chat template,
`generation_config.json`), a bare `tokenizer.json`, or the built-in character vocabulary of the built-in task
(small, so a tiny model learns it in minutes on a CPU).

Stop ids come from the checkpoint, all of them: chat and hybrid-thinking checkpoints end a turn with one token
(Qwen3: `<|im_end|>`, 151645) and a document with another (`<|endoftext|>`, 151643), and their
`generation_config.json` lists both. A completion that ends with either has finished; taking only one makes
completions run to `max_tokens` and be scored as truncated.

Chat templates are rendered with jinja2 the way transformers renders them (a sandboxed environment with
trim_blocks and lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`, the special tokens as
variables and template keywords such as Qwen3's `enable_thinking`), without importing transformers."""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

BUILTIN_VOCAB = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "-", "*", "=", " ")
# A bare tokenizer.json names no end-of-sequence token: every one of these it holds ends a completion.
EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

Message = dict[str, Any]


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int  # the checkpoint's primary end-of-sequence id (first of eos_ids)
    eos_ids: tuple[int, ...]  # every id that ends a completion; the engine stops a row on any of them
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class UnknownText(ValueError):
    """The text holds characters the vocabulary cannot express."""


class TokenizerError(ValueError):
    """A tokenizer's files are missing or inconsistent; the message names the file and the field."""


class CharTokenizer:
    """One token per character of BUILTIN_VOCAB; prompts start with <bos>."""

    chat_template = None

    def __init__(self) -> None:
        self.ids = {tok: i for i, tok in enumerate(BUILTIN_VOCAB)}
        self.vocab_size = len(BUILTIN_VOCAB)
        self.eos_id, self.bos_id, self.pad_id = self.ids["<eos>"], self.ids["<bos>"], self.ids["<pad>"]
        self.eos_ids = (self.eos_id,)

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

    def apply_chat_template(self, messages: list[Message], **_: Any) -> str:
        raise TokenizerError("the built-in tokenizer has no chat template; give a Hugging Face model directory in "
                             "rl.sampling.tokenizer, or plain-text prompts")


class HFTokenizer:
    """A `tokenizers` tokenizer with the special tokens, stop ids and chat template of its model directory."""

    def __init__(self, tokenizer_json: str | Path, *, config: dict | None = None,
                 generation_config: dict | None = None, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.source = str(tokenizer_json)
        self.tok = _Tokenizer.from_file(self.source)
        self.config = config or {}
        self.vocab_size = self.tok.get_vocab_size()
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in SPECIAL_TOKEN_KEYS
                               if _token_text(self.config.get(k)) is not None}
        self.chat_template = chat_template
        self.eos_ids = self._eos_ids(generation_config or {})
        self.eos_id = self.eos_ids[0]
        bos = self.special_tokens.get("bos_token")
        self.bos_id = self._id(bos, "tokenizer_config.json: bos_token") if bos is not None else None

    def _id(self, token: str, where: str) -> int:
        found = self.tok.token_to_id(token)
        if found is None:
            raise TokenizerError(f"{self.source}: {where}: {token!r} is not in the vocabulary")
        return found

    def _eos_ids(self, generation_config: dict) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self.special_tokens.get("eos_token")
        if eos is not None:
            ids.append(self._id(eos, "tokenizer_config.json: eos_token"))
        listed = generation_config.get("eos_token_id")
        for i in ([listed] if isinstance(listed, int) else listed or []):
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise TokenizerError(f"generation_config.json: eos_token_id: {listed!r} is not allowed; expected "
                                     f"token ids below the vocabulary size {self.vocab_size}")
            ids.append(i)
        if not ids:
            ids = [i for t in EOS_CANDIDATES if (i := self.tok.token_to_id(t)) is not None]
        if not ids:
            raise TokenizerError(f"tokenizer {self.source}: no end-of-sequence token; expected eos_token in "
                                 f"tokenizer_config.json, eos_token_id in generation_config.json, or one of "
                                 f"{EOS_CANDIDATES} in the vocabulary")
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str) -> list[int]:
        # Special tokens come from the text itself (a rendered chat template writes them), never added here.
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the model directory has no chat template (chat_template in "
                                 "tokenizer_config.json or chat_template.jinja); prompts must be plain text")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[Message], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages` (role/content mappings), as transformers' apply_chat_template renders it
        with tokenize=False; template keywords (Qwen3: enable_thinking=False) pass through."""
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **template_kwargs)


def compile_chat_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %} marks assistant spans for training masks; rendering a prompt keeps the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # Templates from the Hub are untrusted code: the sandbox keeps them from reaching Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as its text or as a serialized AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None


def load_model_tokenizer(directory: str | Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise TokenizerError(f"{directory}: no tokenizer.json; expected a Hugging Face model directory "
                             "(tokenizer.json, tokenizer_config.json, generation_config.json)")
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one renders prompts
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if (directory / "chat_template.jinja").is_file():  # newer checkpoints keep the template in its own file
        template = (directory / "chat_template.jinja").read_text()
    return HFTokenizer(directory / "tokenizer.json", config=config,
                       generation_config=_read_json(directory / "generation_config.json"), chat_template=template)


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
    """`builtin`, a Hugging Face model directory, or the path of a bare tokenizer.json."""
    if spec == "builtin":
        return CharTokenizer()
    if Path(spec).is_dir():
        return load_model_tokenizer(spec)
    return HFTokenizer(spec)


# --- the tokenizer files of a published checkpoint ---------------------------------------------------------------

def builtin_tokenizer_json():
    """The built-in character vocabulary as a `tokenizers` tokenizer (one token per character, <bos> first), so a
    checkpoint of the built-in task carries a tokenizer that transformers loads."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ids = {tok: i for i, tok in enumerate(BUILTIN_VOCAB)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(BUILTIN_VOCAB[:3]))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ids["<bos>"])])
    return tok


def generation_config(tokenizer: CharTokenizer | HFTokenizer, *, temperature: float = 1.0, top_p: float = 1.0
                      ) -> dict:
    """generation_config.json: every EOS id (transformers and vLLM stop on any of them) and the run's sampling."""
    pad = getattr(tokenizer, "pad_id", None)
    if isinstance(tokenizer, HFTokenizer) and "pad_token" in tokenizer.special_tokens:
        pad = tokenizer.tok.token_to_id(tokenizer.special_tokens["pad_token"])
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.eos_ids),
            "pad_token_id": tokenizer.eos_id if pad is None else pad,
            "do_sample": temperature > 0, "temperature": temperature, "top_p": top_p}


def write_tokenizer_files(spec: str, directory: str | Path, *, temperature: float = 1.0, top_p: float = 1.0) -> None:
    """Put the tokenizer files and generation_config.json of tokenizer `spec` (as rl.sampling.tokenizer takes it)
    into the checkpoint directory `directory`, so a published version is a complete Hugging Face checkpoint.
    A model directory's own files are copied as they are (its generation_config.json included); a bare
    tokenizer.json or the built-in vocabulary gets a tokenizer_config.json naming its special tokens."""
    import shutil

    directory = Path(directory)
    tokenizer = load_tokenizer(spec)
    if Path(spec).is_dir():
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (Path(spec) / name).is_file():
                shutil.copyfile(Path(spec) / name, directory / name)
        if (Path(spec) / "generation_config.json").is_file():
            return
    else:
        if spec == "builtin":
            builtin_tokenizer_json().save(str(directory / "tokenizer.json"))
            names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
        else:
            shutil.copyfile(spec, directory / "tokenizer.json")
            names = {"eos_token": tokenizer.tok.id_to_token(tokenizer.eos_id)}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps(generation_config(tokenizer, temperature=temperature, top_p=top_p), indent=2))


def write_checkpoint_metadata(directory: str | Path, run) -> None:
    """What a published version needs next to its weights and config.json (`run`: the RunConfig): the run's
    tokenizer files and generation_config.json. Called by the weight publisher while it stages a version."""
    s = run.rl.sampling
    write_tokenizer_files(s.tokenizer, directory, temperature=s.temperature, top_p=s.top_p)
