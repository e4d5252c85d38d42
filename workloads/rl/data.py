"""Prompts for the RL loop: the built-in arithmetic task, or a dataset in verl's column layout (Parquet or JSONL,
from a local path, the FSx mount or S3), behind one interface, `PromptSource`.

A dataset is drawn in a seeded permutation per epoch; the cursor (epoch, position) is the source's whole state,
so a checkpointed orchestrator resumes at exactly the next prompt. Prompts are tokenized when drawn: chat
messages through the tokenizer's chat template, plain text as it is. A prompt longer than
`rl.sampling.max_prompt_tokens` (servers refuse it) is skipped and counted, as verl filters overlong prompts.

Torch-free: the orchestrator imports it."""
from __future__ import annotations

import json
import random
import threading
from itertools import islice
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moe_rl_eks.core.rl_config import DataColumns, DataConfig, TaskConfig

from .tokenizer import CharTokenizer, HFTokenizer

BUILTIN_SOURCE = "arithmetic"


class DataError(ValueError):
    """A dataset cannot be read as configured; the message names the file, the column or row, and what is expected."""


@dataclass(frozen=True)
class Prompt:
    index: int  # unique per draw within a run (epoch * rows + position for a dataset): seeds derive from it
    prompt_ids: tuple[int, ...]
    text: str  # the rendered prompt (after the chat template)
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


class PromptSource(Protocol):
    def next(self) -> Prompt: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


# --- the built-in task -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    answer: str


class ArithmeticTask:
    """Problem i is a pure function of (seed, i), so a resumed run draws the same prompts from its cursor."""

    def __init__(self, cfg: TaskConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def problem(self, index: int) -> Problem:
        rng = random.Random(self.seed * 1_000_003 + index)
        a, b = rng.randint(0, self.cfg.max_operand), rng.randint(0, self.cfg.max_operand)
        op = rng.choice(self.cfg.operators)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(index, f"{a}{op}{b}=", str(answer))

    def well_formed_example(self, index: int) -> str:
        """A completion of the right shape but a random value: the supervised warm-up teaches the format only,
        so the reward that RL adds is measured separately from what warm-up taught."""
        rng = random.Random(self.seed * 7_919 + index)
        answers = sorted({int(self.problem(i).answer) for i in range(64)})
        return str(rng.randint(min(answers), max(answers)))


class ArithmeticSource:
    """The built-in task as a PromptSource: prompt i is problem i; the state is the cursor. Thread-safe (one lock
    around the cursor)."""

    def __init__(self, task: ArithmeticTask, tokenizer: CharTokenizer | HFTokenizer, start: int = 0) -> None:
        self.task, self.tokenizer, self.cursor = task, tokenizer, start
        self._lock = threading.Lock()

    def prompt(self, index: int) -> Prompt:
        p = self.task.problem(index)
        return Prompt(index, tuple(self.tokenizer.encode(p.prompt)), p.prompt, BUILTIN_SOURCE, p.answer, {})

    def next(self) -> Prompt:
        with self._lock:
            index, self.cursor = self.cursor, self.cursor + 1
        return self.prompt(index)

    def state(self) -> dict:
        with self._lock:
            return {"kind": BUILTIN_SOURCE, "cursor": self.cursor}

    def restore(self, state: dict) -> None:
        _expect_kind(state, BUILTIN_SOURCE)
        with self._lock:
            self.cursor = int(state["cursor"])


# --- datasets ----------------------------------------------------------------------------------------------------

class Rows:
    """The rows of one dataset file, read once, each converted to Python objects when asked for."""

    def __init__(self, uri: str, *, s3_endpoint_url: str | None = None) -> None:
        self.uri = uri
        data = _read_bytes(uri, s3_endpoint_url)
        if uri.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                self._table = pq.read_table(pa.BufferReader(data))
            except pa.ArrowException as exc:
                raise DataError(f"{uri}: not a readable Parquet file ({exc})") from None
            self.columns = {f.name: f.type for f in self._table.schema}
            self._lines = None
        else:
            self._lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
            self._table = None
            self.columns = dict.fromkeys(self.row(0)) if self._lines else {}

    def __len__(self) -> int:
        return len(self._lines) if self._lines is not None else self._table.num_rows

    def row(self, i: int) -> dict:
        if self._table is not None:
            return self._table.slice(i, 1).to_pylist()[0]
        try:
            row = json.loads(self._lines[i])
        except json.JSONDecodeError as exc:
            raise DataError(f"{self.uri}: line {i + 1}: not valid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise DataError(f"{self.uri}: line {i + 1}: expected a JSON object per line, got {type(row).__name__}")
        return row

    def has_column(self, dotted: str) -> bool:
        """Whether the (possibly nested) column exists: Parquet answers from its schema, JSONL from its first row."""
        head, *rest = dotted.split(".")
        if head not in self.columns:
            return False
        if self._table is None:
            return _get(self.row(0), dotted) is not _MISSING
        import pyarrow as pa

        kind = self.columns[head]
        for name in rest:
            if not pa.types.is_struct(kind) or kind.get_field_index(name) < 0:
                return False
            kind = kind.field(name).type
        return True


_MISSING = object()


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for name in dotted.split("."):
        if not isinstance(value, dict) or name not in value:
            return _MISSING
        value = value[name]
    return value


def _read_bytes(uri: str, s3_endpoint_url: str | None) -> bytes:
    if uri.startswith("s3://"):
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = uri[5:].split("/", 1)
        try:
            return boto3.client("s3", endpoint_url=s3_endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise DataError(f"{uri}: cannot read it from S3 ({exc})") from None
    path = Path(uri)
    if not path.is_file():
        raise DataError(f"{uri}: no such file")
    return path.read_bytes()


class Dataset:
    """One split: rows plus the column mapping and how prompts are rendered and tokenized."""

    def __init__(self, rows: Rows, columns: DataColumns, tokenizer: CharTokenizer | HFTokenizer, *,
                 chat_template_kwargs: dict | None = None, max_prompt_tokens: int | None = None) -> None:
        self.rows, self.columns, self.tokenizer = rows, columns, tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.max_prompt_tokens = max_prompt_tokens
        if not len(rows):
            raise DataError(f"{rows.uri}: the dataset has no rows")
        for name in ("prompt", "ground_truth"):
            column = getattr(columns, name)
            if not rows.has_column(column):
                raise DataError(f"{rows.uri}: no column {column!r} (rl.data.columns.{name}); columns: "
                                f"{', '.join(rows.columns)}")
        self._data_source = rows.has_column(columns.data_source)
        self._extra_info = rows.has_column(columns.extra_info)
        self.default_source = Path(rows.uri).stem

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, row_index: int, index: int) -> Prompt | None:
        """Row `row_index` as the prompt of draw `index`; None when it is longer than max_prompt_tokens."""
        row = self.rows.row(row_index)
        where = f"{self.rows.uri}: row {row_index}"
        raw, truth = _get(row, self.columns.prompt), _get(row, self.columns.ground_truth)
        if truth is _MISSING:
            raise DataError(f"{where}: no {self.columns.ground_truth!r} (rl.data.columns.ground_truth)")
        if isinstance(raw, str):
            text = raw
        elif isinstance(raw, list) and raw and all(isinstance(m, dict) and "role" in m and "content" in m for m in raw):
            text = self.tokenizer.apply_chat_template(raw, add_generation_prompt=True, **self.chat_template_kwargs)
        else:
            raise DataError(f"{where}: {self.columns.prompt!r} is {raw!r}; expected text or chat messages "
                            "[{role, content}, ...]")
        ids = tuple(self.tokenizer.encode(text))
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return None
        source = _get(row, self.columns.data_source) if self._data_source else self.default_source
        extra = _get(row, self.columns.extra_info) if self._extra_info else {}
        return Prompt(index, ids, text, str(source), truth, extra if isinstance(extra, dict) else {})


def permutation(rows: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order: a pure function of (seed, epoch), so a resumed run recomputes it."""
    order = list(range(rows))
    random.Random(f"moerl-data:{seed}:{epoch}").shuffle(order)
    return order


class DatasetSource:
    """Draws a dataset's rows in a seeded permutation per epoch (file order with shuffle off).

    State: {epoch, position} plus the row count and seed it was taken with, so restoring it against another
    dataset fails loudly instead of drawing different prompts. Thread-safe: one lock covers the cursor."""

    KIND = "dataset"

    def __init__(self, dataset: Dataset, *, seed: int, shuffle: bool = True) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.epoch, self.position, self.skipped = 0, 0, 0
        self._order = self._epoch_order(0)
        self._lock = threading.Lock()

    def _epoch_order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        return permutation(n, self.seed, epoch) if self.shuffle else list(range(n))

    def next(self) -> Prompt:
        with self._lock:
            for _ in range(len(self.dataset) + 1):
                if self.position == len(self._order):
                    self.epoch, self.position = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
                index = self.epoch * len(self._order) + self.position
                prompt = self.dataset.prompt(self._order[self.position], index)
                self.position += 1
                if prompt is not None:
                    return prompt
                self.skipped += 1
        raise DataError(f"{self.dataset.rows.uri}: every prompt is longer than rl.sampling.max_prompt_tokens "
                        f"({self.dataset.max_prompt_tokens})")

    def state(self) -> dict:
        with self._lock:
            return {"kind": self.KIND, "epoch": self.epoch, "position": self.position, "rows": len(self.dataset),
                    "seed": self.seed, "shuffle": self.shuffle}

    def restore(self, state: dict) -> None:
        _expect_kind(state, self.KIND)
        mine = {"rows": len(self.dataset), "seed": self.seed, "shuffle": self.shuffle}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise DataError(f"{self.dataset.rows.uri}: the checkpoint's data cursor was taken with {theirs}, this run "
                            f"has {mine}; the dataset or rl.training.seed changed, so it cannot resume exactly")
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._order = self._epoch_order(self.epoch)


def _expect_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise DataError(f"data cursor: kind {state.get('kind')!r} cannot be restored into a {kind!r} source; "
                        "the run's rl.data changed since the checkpoint")


def load_split(cfg: DataConfig, split: str, tokenizer: CharTokenizer | HFTokenizer,
               max_prompt_tokens: int | None = None) -> Dataset:
    uri = getattr(cfg, split)
    return Dataset(Rows(uri, s3_endpoint_url=cfg.s3_endpoint_url), cfg.columns, tokenizer,
                   chat_template_kwargs=cfg.chat_template_kwargs, max_prompt_tokens=max_prompt_tokens)


def make_prompt_source(run, tokenizer: CharTokenizer | HFTokenizer) -> ArithmeticSource | DatasetSource:
    """The training prompts of a run (`run`: a RunConfig)."""
    rl = run.rl
    check_vocabulary(run, tokenizer)
    if rl.data.builtin:
        return ArithmeticSource(ArithmeticTask(rl.task, rl.training.seed), tokenizer)
    dataset = load_split(rl.data, "train", tokenizer, rl.sampling.max_prompt_tokens)
    return DatasetSource(dataset, seed=rl.training.seed, shuffle=rl.data.shuffle)


# Built-in evaluation problems come from their own seed, so they are not the training stream's first prompts.
EVAL_SEED_OFFSET = 12_345


def evaluation_prompts(run, tokenizer: CharTokenizer | HFTokenizer, limit: int | None = None) -> list[Prompt]:
    """The evaluation split's first `limit` prompts (default rl.evaluation.prompts) in file order, or fresh built-in
    problems for the built-in task. A dataset without an evaluation split has none."""
    rl = run.rl
    limit = rl.evaluation.prompts if limit is None else limit
    if rl.data.builtin:
        source = ArithmeticSource(ArithmeticTask(rl.task, rl.training.seed + EVAL_SEED_OFFSET), tokenizer)
        return [source.prompt(i) for i in range(limit)]
    if rl.data.eval is None:
        return []
    dataset = load_split(rl.data, "eval", tokenizer, rl.sampling.max_prompt_tokens)
    found = (dataset.prompt(i, i) for i in range(len(dataset)))
    return list(islice((p for p in found if p is not None), limit))


def format_examples(run, tokenizer: CharTokenizer | HFTokenizer, start: int, count: int
                    ) -> list[tuple[tuple[int, ...], list[int]]]:
    """Supervised warm-up pairs j = start .. start+count-1: (prompt ids, completion ids ending with the EOS id)
    whose completion has the shape of an answer but is not this prompt's (the built-in task: a random value; a
    dataset: another row's ground truth), so warm-up teaches the format and the RL that follows is measured on
    the task. Pure functions of (rl.training.seed, j)."""
    rl = run.rl
    pairs = []
    if rl.data.builtin:
        task = ArithmeticTask(rl.task, rl.training.seed + 1)
        texts = [(task.problem(j).prompt, task.well_formed_example(j)) for j in range(start, start + count)]
        pairs = [(tuple(tokenizer.encode(p)), answer) for p, answer in texts]
    else:
        dataset = load_split(rl.data, "train", tokenizer, rl.sampling.max_prompt_tokens)
        for j in range(start, start + count):
            rng = random.Random(f"moerl-warmup:{rl.training.seed}:{j}")
            prompt = None
            while prompt is None:
                prompt = dataset.prompt(rng.randrange(len(dataset)), j)
            other = dataset.rows.row(rng.randrange(len(dataset)))
            pairs.append((prompt.prompt_ids, str(_get(other, rl.data.columns.ground_truth))))
    # The built-in tokenizer starts every encoded text with <bos>; a completion continues its prompt without one.
    skip = 1 if isinstance(tokenizer, CharTokenizer) else 0
    return [(p, tokenizer.encode(answer)[skip:] + [tokenizer.eos_id]) for p, answer in pairs]


def check_vocabulary(run, tokenizer: CharTokenizer | HFTokenizer) -> None:
    """A tokenizer whose ids reach past the model's embedding table cannot be trained or served with it."""
    if tokenizer.vocab_size > run.model.vocab_size:
        raise DataError(f"rl.sampling.tokenizer {run.rl.sampling.tokenizer!r} has {tokenizer.vocab_size} tokens, "
                        f"more than model.vocab_size ({run.model.vocab_size}); use the model's own tokenizer")
