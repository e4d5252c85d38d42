"""Prompts for the RL loop: the built-in arithmetic task, or a dataset in verl's column layout (Parquet or JSONL,
from a local path, the FSx mount or S3), behind one interface, `PromptSource`.

A dataset is drawn in a seeded permutation per epoch; the cursor (epoch, position) is the source's whole state,
so a checkpointed orchestrator resumes at exactly the next prompt. Prompts are tokenized when drawn: chat
messages through the tokenizer's chat template, plain text as it is. A prompt longer than
`rl.sampling.max_prompt_tokens` (servers refuse it) is skipped and counted, as verl filters overlong prompts.

Torch-free: the orchestrator imports it."""
from __future__ import annotations

import fnmatch
import glob
import json
import math
import random
import threading
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate, islice
from pathlib import Path
from typing import Any, Protocol

from moe_rl_eks.core.rl_config import DATA_SUFFIXES, GLOB_CHARS, DataColumns, DataConfig, TaskConfig

from .tokenizer import CharTokenizer, HFTokenizer

BUILTIN_SOURCE = "arithmetic"  # the kind of a built-in task's checkpointed cursor (any built-in task)


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
    max_tokens: int | None = None  # this prompt's own completion cap (rl.task random_tokens); None: the run's


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


class CountdownTask:
    """`a-b=` answered by a, a-b, a-2b, ... down to a mod b (TaskConfig.countdown; rl_config says why). Problem i
    is a pure function of (seed, i): its step count log-uniform in [min_steps, max_steps], b in [2, 9]."""

    def __init__(self, cfg: TaskConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def operands(self, index: int) -> tuple[int, int]:
        """Problem `index`'s (a, b)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        low, high = math.log(self.cfg.min_steps), math.log(self.cfg.max_steps + 1)
        steps = min(self.cfg.max_steps, int(math.exp(rng.uniform(low, high))))
        b = rng.randint(2, 9)
        return steps * b + rng.randrange(b), b

    def problem(self, index: int) -> Problem:
        a, b = self.operands(index)
        return Problem(index, f"{a}-{b}=", self.cfg.countdown(a, b))

    def well_formed_example(self, index: int) -> str:
        """A warm-up trace of problem `index`: each step is wrong with probability trace_error_rate (off by 1 to
        b), and counting goes on from the wrong number, so every trace follows the procedure but slips."""
        rng = random.Random(self.seed * 7_919 + index)
        a, b = self.operands(index)
        values, y = [], a
        while y >= b:
            y -= b
            if rng.random() < self.cfg.trace_error_rate:
                y = max(0, y + rng.choice((-1, 1)) * rng.randint(1, b))
            values.append(y)
        return self.cfg.countdown_text(values or [a])


def make_task(cfg: TaskConfig, seed: int) -> ArithmeticTask | CountdownTask:
    return CountdownTask(cfg, seed) if cfg.name == "countdown" else ArithmeticTask(cfg, seed)


class ArithmeticSource:
    """A built-in task as a PromptSource: prompt i is problem i; the state is the cursor. Thread-safe (one lock
    around the cursor)."""

    def __init__(self, task: ArithmeticTask | CountdownTask, tokenizer: CharTokenizer | HFTokenizer,
                 start: int = 0) -> None:
        self.task, self.tokenizer, self.cursor = task, tokenizer, start
        self._lock = threading.Lock()

    def prompt(self, index: int) -> Prompt:
        p = self.task.problem(index)
        return Prompt(index, tuple(self.tokenizer.encode(p.prompt)), p.prompt, self.task.cfg.name, p.answer, {})

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


def log_uniform_floor(mean: float, top: float) -> float:
    """The lower end lo of a log-uniform distribution on [lo, top] whose mean, (top - lo) / ln(top / lo), is
    `mean` (< top), by bisection: the mean rises with lo."""
    low, high = 1e-9, float(mean)
    for _ in range(200):
        lo = (low + high) / 2
        low, high = (lo, high) if (top - lo) / math.log(top / lo) < mean else (low, lo)
    return (low + high) / 2


class RandomTokenSource(ArithmeticSource):
    """rl.task random_tokens: prompt i is task.prompt_tokens token ids drawn uniformly from the model's vocabulary
    and a max_tokens drawn log-uniformly from [lo, max_tokens] (mean task.mean_completion_tokens), both from a
    seed of (run seed, i): a benchmark's workload, the same in every mode of it."""

    def __init__(self, cfg: TaskConfig, seed: int, vocab_size: int, max_tokens: int, start: int = 0) -> None:
        super().__init__(None, None, start)
        self.cfg, self.seed, self.vocab_size, self.max_tokens = cfg, seed, vocab_size, max_tokens
        self.floor = log_uniform_floor(cfg.mean_completion_tokens, max_tokens)

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        ids = tuple(rng.randrange(self.vocab_size) for _ in range(self.cfg.prompt_tokens))
        length = min(self.max_tokens, int(self.floor * (self.max_tokens / self.floor) ** rng.random()))
        return Prompt(index, ids, "", "random_tokens", "", {}, max(1, length))


# --- datasets ----------------------------------------------------------------------------------------------------

class DataFile:
    """The rows of one dataset file, read once, each converted to Python objects when asked for."""

    def __init__(self, uri: str, *, s3=None) -> None:
        self.uri = uri
        data = _read_bytes(uri, s3)
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

    def values(self, dotted: str) -> list:
        """Every row's value of a (possibly nested) column that has_column found."""
        if self._table is None:
            return [_get(self.row(i), dotted) for i in range(len(self))]
        import pyarrow.compute as pc

        head, *rest = dotted.split(".")
        column = self._table.column(head)
        for name in rest:
            column = pc.struct_field(column, name)
        return column.to_pylist()

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


class Rows:
    """The rows of one split: its files back to back (row i of the split is row i - start of the file it falls
    in), so the permutation and cursor of DatasetSource span every file."""

    def __init__(self, files: list[DataFile], description: str) -> None:
        self.files, self.description = files, description
        self._starts = list(accumulate((len(f) for f in files), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    def locate(self, i: int) -> tuple[DataFile, int]:
        """The file holding row i of the split, and the row's index in it."""
        f = bisect_right(self._starts, i) - 1
        return self.files[f], i - self._starts[f]

    def values(self, dotted: str) -> list:
        return [v for f in self.files for v in f.values(dotted)]


_MISSING = object()
_READERS = 8  # files of a split read at once (S3 and FSx reward concurrent reads)


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for name in dotted.split("."):
        if not isinstance(value, dict) or name not in value:
            return _MISSING
        value = value[name]
    return value


def _s3_client(endpoint_url: str | None):
    """One client per split, shared by its reading threads (boto3 clients are thread-safe, creating them is not)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url)


def _read_bytes(uri: str, s3) -> bytes:
    if uri.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = uri[5:].split("/", 1)
        try:
            return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise DataError(f"{uri}: cannot read it from S3 ({exc})") from None
    path = Path(uri)
    if not path.is_file():
        raise DataError(f"{uri}: no such file")
    return path.read_bytes()


def _is_data_file(name: str) -> bool:
    """A dataset file by its name; names starting with . or _ are metadata (Spark's _SUCCESS, .crc), as pyarrow
    skips them."""
    return name.endswith(DATA_SUFFIXES) and not name.startswith((".", "_"))


def _glob_match(pattern: list[str], parts: list[str]) -> bool:
    """Path segments against glob segments as glob.glob matches them: * ? [..] within a segment, ** any depth."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(pattern[1:], parts[1:])


def _s3_files(entry: str, s3, where: str) -> list[str]:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = entry[5:].split("/", 1)
    if not any(c in key for c in GLOB_CHARS):
        if _is_data_file(key.rsplit("/", 1)[-1]):
            return [entry]
        prefix, delimiter = (key if key.endswith("/") or not key else key + "/"), "/"
    else:  # list from the last / before the first wildcard, then match whole keys
        prefix, delimiter = key[:min(key.find(c) for c in GLOB_CHARS if c in key)].rpartition("/")[0], ""
        prefix = prefix + "/" if prefix else ""
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter=delimiter)
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    except (BotoCoreError, ClientError) as exc:
        raise DataError(f"{where}: cannot list {entry!r} in S3 ({exc})") from None
    if delimiter == "":
        keys = [k for k in keys if _glob_match(key.split("/"), k.split("/"))]
    return [f"s3://{bucket}/{k}" for k in sorted(keys) if _is_data_file(k.rsplit("/", 1)[-1])]


def _local_files(entry: str, where: str) -> list[str]:
    if any(c in entry for c in GLOB_CHARS):
        return sorted(p for p in glob.glob(entry, recursive=True) if _is_data_file(Path(p).name) and Path(p).is_file())
    path = Path(entry)
    if path.is_dir():  # also a Spark-style directory named x.parquet
        return sorted(str(p) for p in path.iterdir() if _is_data_file(p.name) and p.is_file())
    if entry.endswith(DATA_SUFFIXES) and path.is_file():
        return [entry]
    raise DataError(f"{where}: {entry!r}: no such file or directory")


def resolve_files(cfg: DataConfig, split: str, s3=None) -> list[str]:
    """The files of rl.data.<split>: each location expanded (a directory or prefix to its data files, a glob to
    its matches, both in name order), in the order listed. A location that matches nothing, or a file that two
    locations name, is an error naming the field."""
    field = f"rl.data.{split}"
    files: list[str] = []
    seen: set[str] = set()  # a split may have thousands of shards
    value = getattr(cfg, split)
    for i, entry in enumerate(cfg.locations(split)):
        where = field if isinstance(value, str) else f"{field}[{i}]"
        found = _s3_files(entry, s3, where) if entry.startswith("s3://") else _local_files(entry, where)
        if not found:
            raise DataError(f"{where}: {entry!r} matched no .parquet or .jsonl file (names starting with . or _ "
                            "are skipped)")
        for uri in found:
            if uri in seen:
                raise DataError(f"{where}: {entry!r} names {uri} again; list each file once")
            seen.add(uri)
        files += found
    return files


def read_split(cfg: DataConfig, split: str) -> Rows:
    """rl.data.<split>'s rows: its files resolved and read (_READERS at once)."""
    uses_s3 = any(entry.startswith("s3://") for entry in cfg.locations(split))
    s3 = _s3_client(cfg.s3_endpoint_url) if uses_s3 else None
    uris = resolve_files(cfg, split, s3)
    with ThreadPoolExecutor(min(_READERS, len(uris))) as pool:
        files = list(pool.map(lambda uri: DataFile(uri, s3=s3), uris))
    description = uris[0] if len(uris) == 1 else f"rl.data.{split} ({len(uris)} files from {uris[0]})"
    return Rows(files, description)


class Dataset:
    """One split: rows plus the column mapping and how prompts are rendered and tokenized."""

    def __init__(self, rows: Rows, columns: DataColumns, tokenizer: CharTokenizer | HFTokenizer, *,
                 chat_template_kwargs: dict | None = None, max_prompt_tokens: int | None = None) -> None:
        self.rows, self.columns, self.tokenizer = rows, columns, tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.max_prompt_tokens = max_prompt_tokens
        if not len(rows):
            raise DataError(f"{rows.description}: the dataset has no rows")
        for file in rows.files:
            for name in ("prompt", "ground_truth"):
                column = getattr(columns, name)
                if len(file) and not file.has_column(column):
                    raise DataError(f"{file.uri}: no column {column!r} (rl.data.columns.{name}); columns: "
                                    f"{', '.join(file.columns)}")
        # Optional columns per file; a file without data_source is named after itself.
        self._optional = {id(f): (f.has_column(columns.data_source) if len(f) else False,
                                  f.has_column(columns.extra_info) if len(f) else False) for f in rows.files}

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, row_index: int, index: int) -> Prompt | None:
        """Row `row_index` as the prompt of draw `index`; None when it is longer than max_prompt_tokens."""
        file, j = self.rows.locate(row_index)
        row = file.row(j)
        where = f"{file.uri}: row {j}"
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
        has_source, has_extra = self._optional[id(file)]
        source = _get(row, self.columns.data_source) if has_source else Path(file.uri).stem
        extra = _get(row, self.columns.extra_info) if has_extra else {}
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
        raise DataError(f"{self.dataset.rows.description}: every prompt is longer than rl.sampling.max_prompt_tokens "
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
            raise DataError(f"{self.dataset.rows.description}: the checkpoint's data cursor was taken with {theirs}, "
                            f"this run has {mine}; the dataset or rl.training.seed changed, so it cannot resume exactly")
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._order = self._epoch_order(self.epoch)


def _expect_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise DataError(f"data cursor: kind {state.get('kind')!r} cannot be restored into a {kind!r} source; "
                        "the run's rl.data changed since the checkpoint")


def load_split(cfg: DataConfig, split: str, tokenizer: CharTokenizer | HFTokenizer,
               max_prompt_tokens: int | None = None) -> Dataset:
    return Dataset(read_split(cfg, split), cfg.columns, tokenizer,
                   chat_template_kwargs=cfg.chat_template_kwargs, max_prompt_tokens=max_prompt_tokens)


def make_prompt_source(run, tokenizer: CharTokenizer | HFTokenizer) -> ArithmeticSource | DatasetSource:
    """The training prompts of a run (`run`: a RunConfig)."""
    rl = run.rl
    check_vocabulary(run, tokenizer)
    if rl.data.builtin and rl.task.name == "random_tokens":
        return RandomTokenSource(rl.task, rl.training.seed, run.model.vocab_size, rl.sampling.max_tokens)
    if rl.data.builtin:
        return ArithmeticSource(make_task(rl.task, rl.training.seed), tokenizer)
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
        source = ArithmeticSource(make_task(rl.task, rl.training.seed + EVAL_SEED_OFFSET), tokenizer)
        return [source.prompt(i) for i in range(limit)]
    if rl.data.eval is None:
        return []
    dataset = load_split(rl.data, "eval", tokenizer, rl.sampling.max_prompt_tokens)
    found = (dataset.prompt(i, i) for i in range(len(dataset)))
    return list(islice((p for p in found if p is not None), limit))


class FormatExamples:
    """Supervised warm-up pairs: (prompt ids, completion ids ending with the EOS id) whose completion has the shape
    of an answer but not the answer: the arithmetic task's is a random value in its answers' range, the countdown
    task's a trace that slips (CountdownTask.well_formed_example); a
    dataset's is drawn uniformly from the split's distinct ground truths, so the warm-up teaches the format and
    which answers exist, not which prompt has which answer nor how often an answer is right. Correctness is left to
    RL, and the evaluation after the warm-up measures what RL adds. Pair j is a pure function of
    (rl.training.seed, j). Built once (a dataset is read here, not at every warm-up step)."""

    def __init__(self, run, tokenizer: CharTokenizer | HFTokenizer) -> None:
        self.run, self.tokenizer = run, tokenizer
        rl = run.rl
        if rl.data.builtin:
            self.task = make_task(rl.task, rl.training.seed + 1)
        else:
            self.dataset = load_split(rl.data, "train", tokenizer, rl.sampling.max_prompt_tokens)
            # a row without a ground truth (missing or null) has no answer to show; RL's reward refuses it later
            self.answers = sorted({str(v) for v in self.dataset.rows.values(rl.data.columns.ground_truth)
                                   if v is not _MISSING and v is not None})

    def pairs(self, start: int, count: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """Pairs j = start .. start + count - 1."""
        tokenizer, pairs = self.tokenizer, []
        if self.run.rl.data.builtin:
            texts = [(self.task.problem(j).prompt, self.task.well_formed_example(j))
                     for j in range(start, start + count)]
            pairs = [(tuple(tokenizer.encode(p)), answer) for p, answer in texts]
        else:
            for j in range(start, start + count):
                rng = random.Random(f"moerl-warmup:{self.run.rl.training.seed}:{j}")
                prompt = None
                while prompt is None:
                    prompt = self.dataset.prompt(rng.randrange(len(self.dataset)), j)
                pairs.append((prompt.prompt_ids, rng.choice(self.answers)))
        # The built-in tokenizer starts every encoded text with <bos>; a completion continues its prompt without one.
        skip = 1 if isinstance(tokenizer, CharTokenizer) else 0
        return [(p, tokenizer.encode(answer)[skip:] + [tokenizer.eos_id]) for p, answer in pairs]


def check_vocabulary(run, tokenizer: CharTokenizer | HFTokenizer) -> None:
    """A tokenizer whose ids reach past the model's embedding table cannot be trained or served with it."""
    if tokenizer.vocab_size > run.model.vocab_size:
        raise DataError(f"rl.sampling.tokenizer {run.rl.sampling.tokenizer!r} has {tokenizer.vocab_size} tokens, "
                        f"more than model.vocab_size ({run.model.vocab_size}); use the model's own tokenizer")
