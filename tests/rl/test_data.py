"""Prompt datasets: Parquet and JSONL in verl's layout from a local path and from S3 (moto's server on 127.0.0.1),
column mapping, chat rendering, a seeded per-epoch permutation whose cursor resumes exactly, the built-in task
behind the same interface, and errors that name the file and column."""
import dataclasses
import json

import pytest

from moe_rl_eks.core.rl_config import DataConfig, TaskConfig
from moe_rl_eks.core.schema import ConfigError, parse
from moe_rl_eks.workloads.rl.data import (ArithmeticSource, ArithmeticTask, DataError, DatasetSource, FormatExamples,
                                          evaluation_prompts, load_split, make_prompt_source, permutation)
from moe_rl_eks.tools.example_data import problems, write_example, write_parquet
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer, load_model_tokenizer


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("example")
    write_example(out, train=12, eval_=5, max_operand=4)
    return out


@pytest.fixture(scope="module")
def tok(example):
    return load_model_tokenizer(example / "tokenizer")


def data_cfg(**fields) -> DataConfig:
    return parse(DataConfig, fields, source="test")


def test_parquet_rows_in_verl_layout_become_chat_prompts(example, tok):
    cfg = data_cfg(train=str(example / "train.parquet"), chat_template_kwargs={"enable_thinking": False})
    dataset = load_split(cfg, "train", tok)
    row = problems(12, 0, 4, "train")[3]
    p = dataset.prompt(3, index=40)
    assert p.index == 40 and p.data_source == "word_problems" and p.ground_truth == row["reward_model"]["ground_truth"]
    assert p.extra_info == {"split": "train", "index": 3, "kind": row["extra_info"]["kind"]}
    assert p.text == tok.apply_chat_template(row["prompt"], enable_thinking=False)
    assert p.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and row["prompt"][1]["content"] in p.text
    assert list(p.prompt_ids) == tok.encode(p.text)


def test_jsonl_reads_the_same_prompts_as_parquet(example, tok, tmp_path):
    rows = problems(12, 0, 4, "train")
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    parquet = load_split(data_cfg(train=str(example / "train.parquet")), "train", tok)
    jsonl = load_split(data_cfg(train=str(tmp_path / "train.jsonl")), "train", tok)
    assert len(jsonl) == len(parquet) == 12
    assert [jsonl.prompt(i, i) for i in range(12)] == [parquet.prompt(i, i) for i in range(12)]


def test_parquet_and_jsonl_from_s3_read_as_from_disk(example, tok, s3_endpoint, tmp_path):
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="datasets")
    s3.upload_file(str(example / "train.parquet"), "datasets", "math/train.parquet")
    s3.put_object(Bucket="datasets", Key="math/eval.jsonl",
                  Body="\n".join(json.dumps(r) for r in problems(5, 0, 4, "eval")).encode())
    cfg = data_cfg(train="s3://datasets/math/train.parquet", eval="s3://datasets/math/eval.jsonl",
                   s3_endpoint_url=s3_endpoint)
    local = load_split(data_cfg(train=str(example / "train.parquet"), eval=str(example / "eval.parquet")), "train", tok)
    remote = load_split(cfg, "train", tok)
    assert [remote.prompt(i, i) for i in range(12)] == [local.prompt(i, i) for i in range(12)]
    assert [p.ground_truth for p in (load_split(cfg, "eval", tok).prompt(i, i) for i in range(5))] == \
        [r["reward_model"]["ground_truth"] for r in problems(5, 0, 4, "eval")]
    with pytest.raises(DataError, match="s3://datasets/math/missing.parquet: cannot read it from S3"):
        load_split(data_cfg(train="s3://datasets/math/missing.parquet", s3_endpoint_url=s3_endpoint), "train", tok)


def shards(rows: list[dict], directory, sizes: list[int], suffix: str = "parquet") -> list[str]:
    """`rows` cut into files of `sizes` rows named part-0.parquet, part-1.parquet, ... in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    names, start = [], 0
    for i, size in enumerate(sizes):
        path = directory / f"part-{i}.{suffix}"
        if suffix == "parquet":
            write_parquet(rows[start:start + size], path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows[start:start + size]))
        names.append(str(path))
        start += size
    return names


def test_a_split_of_several_files_reads_as_one_in_name_order(example, tok, tmp_path):
    rows = problems(12, 0, 4, "train")
    whole = load_split(data_cfg(train=str(example / "train.parquet")), "train", tok)
    expected = [whole.prompt(i, i) for i in range(12)]
    files = shards(rows, tmp_path / "parts", [5, 4, 3])
    (tmp_path / "parts" / "_SUCCESS").write_text("")  # metadata beside the data, as Spark writes it, is skipped
    (tmp_path / "parts" / ".part-0.parquet.crc").write_text("")
    (tmp_path / "parts" / "nested").mkdir()  # a directory's subdirectories are not read
    shards(rows[:2], tmp_path / "parts" / "nested", [2])
    for train in (str(tmp_path / "parts"), str(tmp_path / "parts") + "/", str(tmp_path / "parts" / "part-*.parquet"),
                  files, [files[0], str(tmp_path / "parts" / "part-[12].parquet")]):
        dataset = load_split(data_cfg(train=train), "train", tok)
        assert len(dataset) == 12 and [dataset.prompt(i, i) for i in range(12)] == expected, train
    deep = load_split(data_cfg(train=str(tmp_path / "parts" / "**" / "*.parquet")), "train", tok)
    assert len(deep) == 14  # ** reaches the nested directory too
    mixed = [files[0], *shards(rows[5:], tmp_path / "jsonl", [7], suffix="jsonl")]  # Parquet and JSONL in one split
    assert [load_split(data_cfg(train=mixed), "train", tok).prompt(i, i) for i in range(12)] == expected


def test_the_permutation_and_cursor_span_every_file_of_a_split(tok, tmp_path):
    rows = problems(23, 0, 4, "train")
    dataset = load_split(data_cfg(train=shards(rows, tmp_path / "parts", [10, 1, 12])), "train", tok)
    source = DatasetSource(dataset, seed=3)
    first_epoch = [source.next().extra_info["index"] for _ in range(23)]
    assert sorted(first_epoch) == list(range(23))  # every row of every file, once
    assert first_epoch == [permutation(23, seed=3, epoch=0)[i] for i in range(23)]
    source.next()
    state = json.loads(json.dumps(source.state()))
    expected = [source.next() for _ in range(30)]  # the rest of epoch 1 and into epoch 2
    resumed = DatasetSource(load_split(data_cfg(train=str(tmp_path / "parts")), "train", tok), seed=3)
    resumed.restore(state)
    assert [resumed.next() for _ in range(30)] == expected
    fewer = load_split(data_cfg(train=str(tmp_path / "parts" / "part-[02].parquet")), "train", tok)
    with pytest.raises(DataError, match=r"rl.data.train \(2 files from .*part-0.parquet\): the checkpoint's data "
                                        r"cursor was taken with \{'rows': 23"):
        DatasetSource(fewer, seed=3).restore(state)


def test_several_files_from_an_s3_prefix_a_glob_and_a_list(tok, s3_endpoint, tmp_path):
    import boto3

    rows = problems(12, 0, 4, "train")
    files = shards(rows, tmp_path / "parts", [5, 4, 3])
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="shards")
    for f in files:
        s3.upload_file(f, "shards", f"math/train/{f.rsplit('/', 1)[1]}")
    s3.put_object(Bucket="shards", Key="math/train/_SUCCESS", Body=b"")
    s3.upload_file(files[0], "shards", "math/train/old/part-9.parquet")  # below the prefix: not read
    s3.upload_file(files[0], "shards", "math/train-copy.parquet")  # beside the prefix: not read
    expected = [load_split(data_cfg(train=files), "train", tok).prompt(i, i) for i in range(12)]
    for train in ("s3://shards/math/train", "s3://shards/math/train/", "s3://shards/math/train/part-*.parquet",
                  "s3://shards/math/*/part-?.parquet",
                  ["s3://shards/math/train/part-0.parquet", "s3://shards/math/train/part-[12].parquet"]):
        dataset = load_split(data_cfg(train=train, s3_endpoint_url=s3_endpoint), "train", tok)
        assert [dataset.prompt(i, i) for i in range(len(dataset))] == expected, train
    deep = load_split(data_cfg(train="s3://shards/math/**/*.parquet", s3_endpoint_url=s3_endpoint), "train", tok)
    assert len(deep) == 22  # train-copy, the three parts and old/part-9
    source = DatasetSource(load_split(data_cfg(train="s3://shards/math/train/", s3_endpoint_url=s3_endpoint),
                                      "train", tok), seed=1)
    assert sorted(source.next().extra_info["index"] for _ in range(12)) == list(range(12))
    with pytest.raises(DataError, match=r"rl.data.train: 's3://shards/nothing/' matched no .parquet or .jsonl"):
        load_split(data_cfg(train="s3://shards/nothing/", s3_endpoint_url=s3_endpoint), "train", tok)
    with pytest.raises(DataError, match=r"rl.data.eval\[1\]: cannot list 's3://missing-bucket/x/' in S3"):
        load_split(data_cfg(train="t.parquet", eval=["s3://shards/math/train/", "s3://missing-bucket/x/"],
                            s3_endpoint_url=s3_endpoint), "eval", tok)


def test_split_locations_that_match_nothing_or_repeat_a_file_are_named(tok, tmp_path):
    files = shards(problems(6, 0, 4, "train"), tmp_path / "parts", [3, 3])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"rl.data.train: '.*empty' matched no .parquet or .jsonl file"):
        load_split(data_cfg(train=str(tmp_path / "empty")), "train", tok)
    with pytest.raises(DataError, match=r"rl.data.train\[1\]: '.*part-\*.parquet' matched no"):
        load_split(data_cfg(train=[files[0], str(tmp_path / "empty" / "part-*.parquet")]), "train", tok)
    with pytest.raises(DataError, match=r"rl.data.train\[1\]: '.*parts' names .*part-0.parquet again; list each "
                                        r"file once"):
        load_split(data_cfg(train=[files[0], str(tmp_path / "parts")]), "train", tok)
    with pytest.raises(DataError, match=r"rl.data.train: '.*missing-dir': no such file or directory"):
        load_split(data_cfg(train=str(tmp_path / "missing-dir")), "train", tok)
    (tmp_path / "parts" / "part-1.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"part-1.parquet: not a readable Parquet file"):
        load_split(data_cfg(train=str(tmp_path / "parts")), "train", tok)
    write_parquet([{"question": "q", "answer": "1"}], tmp_path / "parts" / "part-1.parquet")
    with pytest.raises(DataError, match=r"part-1.parquet: no column 'prompt' \(rl.data.columns.prompt\); columns: "
                                        r"question, answer"):
        load_split(data_cfg(train=str(tmp_path / "parts")), "train", tok)


def test_column_mapping_reaches_nested_fields_and_optional_columns_default(tok, tmp_path):
    write_parquet([{"question": "Ann has 3 apples.", "answer": {"value": "3", "unit": "apples"}},
                   {"question": "Ben has 2 coins.", "answer": {"value": "2", "unit": "coins"}}], tmp_path / "qa.parquet")
    cfg = data_cfg(train=str(tmp_path / "qa.parquet"), columns={"prompt": "question", "ground_truth": "answer.value"})
    p = load_split(cfg, "train", tok).prompt(1, 1)
    assert (p.text, p.ground_truth, p.data_source, p.extra_info) == ("Ben has 2 coins.", "2", "qa", {})
    bad = data_cfg(train=str(tmp_path / "qa.parquet"), columns={"prompt": "question", "ground_truth": "answer.nope"})
    with pytest.raises(DataError, match=r"qa.parquet: no column 'answer.nope' \(rl.data.columns.ground_truth\); "
                                        r"columns: question, answer"):
        load_split(bad, "train", tok)


def test_bad_rows_and_files_name_the_file_and_row(tok, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n[1, 2]\n')
    dataset = load_split(data_cfg(train=str(tmp_path / "bad.jsonl")), "train", tok)
    with pytest.raises(DataError, match="bad.jsonl: line 2: expected a JSON object per line"):
        dataset.prompt(1, 1)
    write_parquet([{"prompt": 7, "reward_model": {"ground_truth": "1"}}], tmp_path / "num.parquet")
    with pytest.raises(DataError, match=r"num.parquet: row 0: 'prompt' is 7; expected text or chat messages"):
        load_split(data_cfg(train=str(tmp_path / "num.parquet")), "train", tok).prompt(0, 0)
    with pytest.raises(DataError, match=r"rl.data.train: '.*nothing.parquet': no such file or directory"):
        load_split(data_cfg(train=str(tmp_path / "nothing.parquet")), "train", tok)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable Parquet file"):
        load_split(data_cfg(train=str(tmp_path / "junk.parquet")), "train", tok)


def test_each_epoch_is_a_seeded_permutation_of_every_row():
    first, second = permutation(50, seed=7, epoch=0), permutation(50, seed=7, epoch=1)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second and first != list(range(50))
    assert first == permutation(50, seed=7, epoch=0) and first != permutation(50, seed=8, epoch=0)


def test_cursor_checkpoints_and_resumes_at_exactly_the_next_prompt_across_epochs(example, tok):
    dataset = load_split(data_cfg(train=str(example / "train.parquet")), "train", tok)
    source = DatasetSource(dataset, seed=3)
    drawn = [source.next() for _ in range(17)]  # 12 rows: into the second epoch
    assert [p.index for p in drawn] == list(range(17))
    assert sorted(p.extra_info["index"] for p in drawn[:12]) == list(range(12))
    state = json.loads(json.dumps(source.state()))  # what a checkpoint holds
    expected = [source.next() for _ in range(20)]
    resumed = DatasetSource(dataset, seed=3)
    resumed.restore(state)
    assert [resumed.next() for _ in range(20)] == expected
    with pytest.raises(DataError, match="rl.training.seed changed"):
        DatasetSource(dataset, seed=4).restore(state)
    with pytest.raises(DataError, match="kind 'dataset' cannot be restored into a 'arithmetic' source"):
        ArithmeticSource(ArithmeticTask(TaskConfig(), 0), CharTokenizer()).restore(state)
    in_order = DatasetSource(dataset, seed=3, shuffle=False)
    assert [in_order.next().extra_info["index"] for _ in range(13)] == [*range(12), 0]


def test_overlong_prompts_are_skipped_and_counted(example, tok):
    lengths = [len(load_split(data_cfg(train=str(example / "train.parquet")), "train", tok).prompt(i, i).prompt_ids)
               for i in range(12)]
    limit = sorted(lengths)[6]
    source = DatasetSource(load_split(data_cfg(train=str(example / "train.parquet")), "train", tok, limit), seed=0)
    short = {i for i, n in enumerate(lengths) if n <= limit}
    drawn = [source.next() for _ in range(len(short))]  # one epoch's worth
    assert {p.extra_info["index"] for p in drawn} == short and all(len(p.prompt_ids) <= limit for p in drawn)
    assert 0 < source.skipped <= 12 - len(short)
    with pytest.raises(DataError, match="every prompt is longer than rl.sampling.max_prompt_tokens"):
        DatasetSource(load_split(data_cfg(train=str(example / "train.parquet")), "train", tok, 3), seed=0).next()


def test_builtin_arithmetic_is_a_prompt_source_with_a_resumable_cursor():
    source = ArithmeticSource(ArithmeticTask(TaskConfig(), seed=5), CharTokenizer())
    first = [source.next() for _ in range(4)]
    assert [p.index for p in first] == [0, 1, 2, 3] and first[0].data_source == "arithmetic"
    assert first[2].text.endswith("=") and list(first[2].prompt_ids) == CharTokenizer().encode(first[2].text)
    resumed = ArithmeticSource(ArithmeticTask(TaskConfig(), seed=5), CharTokenizer())
    resumed.restore(source.state())
    assert resumed.next() == source.next()


def test_a_run_picks_its_sources_from_rl_data(example, tmp_path):
    from rl_helpers import tiny_run

    builtin = tiny_run(tmp_path)
    assert isinstance(make_prompt_source(builtin, CharTokenizer()), ArithmeticSource)
    assert len(evaluation_prompts(builtin, CharTokenizer(), limit=6)) == 6
    run = tiny_run(tmp_path, data={"train": str(example / "train.parquet"), "eval": str(example / "eval.parquet")},
                   sampling={"tokenizer": str(example / "tokenizer"), "max_prompt_tokens": 512})
    tok = load_model_tokenizer(example / "tokenizer")
    wide = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=tok.vocab_size))
    assert isinstance(make_prompt_source(wide, tok), DatasetSource)
    evals = evaluation_prompts(run, tok, limit=3)
    assert [p.extra_info["index"] for p in evals] == [0, 1, 2] and evals[0].extra_info["split"] == "eval"


def test_data_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"test: train: 'data.csv' is not allowed; expected a .parquet or .jsonl"):
        data_cfg(train="data.csv")
    with pytest.raises(ConfigError, match=r"train: 's3://bucket.parquet' is not allowed; expected s3://bucket/key"):
        data_cfg(train="s3://bucket.parquet")
    with pytest.raises(ConfigError, match=r"train\[1\]: 'x/data.json' is not allowed; expected a .parquet or .jsonl "
                                          r"file, a directory or S3 prefix"):
        data_cfg(train=["a.parquet", "x/data.json"])
    with pytest.raises(ConfigError, match=r"train\[0\]: 's3://b\*/k/' is not allowed; expected s3://bucket/key"):
        data_cfg(train=["s3://b*/k/"])
    with pytest.raises(ConfigError, match=r"train: \(\) is not allowed; list at least one file"):
        data_cfg(train=[])
    with pytest.raises(ConfigError, match=r"eval: .* needs a training dataset"):
        data_cfg(eval="e.parquet")
    with pytest.raises(ConfigError, match=r"columns.prompt: 'a..b' is not allowed"):
        data_cfg(train="t.parquet", columns={"prompt": "a..b"})
    # directories, prefixes and globs are locations too; a directory whose name has a dot ends with /
    assert data_cfg(train=["/fsx/data/", "/fsx/v1.2/", "s3://b/p", "s3://b/p/*.parquet", "d/**/*.jsonl"]).train


def test_a_dataset_with_the_builtin_tokenizer_is_refused(tmp_path):
    from rl_helpers import tiny_run

    with pytest.raises(ConfigError, match=r"rl.sampling.tokenizer: 'builtin' is not allowed; a dataset"):
        tiny_run(tmp_path, data={"train": "t.parquet"})


def test_warmup_pairs_have_an_answers_shape_but_no_knowledge_of_the_task(example, tmp_path):
    from rl_helpers import tiny_run

    builtin = tiny_run(tmp_path)
    char = CharTokenizer()
    pairs = FormatExamples(builtin, char).pairs(0, 20)
    assert pairs == FormatExamples(builtin, char).pairs(0, 20) and len(pairs) == 20
    assert all(c[-1] == char.eos_id and char.decode(c[:-1]).lstrip("-").isdigit() for _, c in pairs)
    assert all(char.decode(list(p)).endswith("=") for p, _ in pairs)
    run = tiny_run(tmp_path, data={"train": str(example / "train.parquet")},
                   sampling={"tokenizer": str(example / "tokenizer"), "max_prompt_tokens": 512})
    tok = load_model_tokenizer(example / "tokenizer")
    warmup = FormatExamples(run, tok)
    truths = sorted({r["reward_model"]["ground_truth"] for r in problems(12, 0, 4, "train")})
    assert warmup.answers == truths
    pairs = warmup.pairs(5, 600)
    answers = [tok.decode(c[:-1]) for _, c in pairs]
    assert all(c[-1] == tok.eos_id for _, c in pairs) and set(answers) == set(truths)
    # uniform over the distinct answers, not weighted by how often each is right: every answer about equally often
    assert max(answers.count(a) for a in truths) < 2.5 * min(answers.count(a) for a in truths)
    assert all(tok.decode(list(p)).endswith("assistant\n") for p, _ in pairs)
    assert pairs[:3] == warmup.pairs(5, 3)


def test_warmup_answers_leave_out_rows_without_a_ground_truth(example, tmp_path):
    from rl_helpers import tiny_run

    rows = [{"prompt": "a", "reward_model": {"ground_truth": "1"}}, {"prompt": "b", "reward_model": {}},
            {"prompt": "c", "reward_model": {"ground_truth": None}}, {"prompt": "d", "reward_model": {"ground_truth": 2}}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tiny_run(tmp_path, data={"train": str(tmp_path / "train.jsonl")},
                   sampling={"tokenizer": str(example / "tokenizer"), "max_prompt_tokens": 512})
    assert FormatExamples(run, load_model_tokenizer(example / "tokenizer")).answers == ["1", "2"]


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(example, tmp_path):
    from rl_helpers import tiny_run

    run = tiny_run(tmp_path, data={"train": str(example / "train.parquet")},
                   sampling={"tokenizer": str(example / "tokenizer"), "max_prompt_tokens": 512})
    with pytest.raises(DataError, match=r"has \d+ tokens, more than model.vocab_size \(32\)"):
        make_prompt_source(run, load_model_tokenizer(example / "tokenizer"))


def test_random_token_prompts_draw_long_tailed_lengths_of_the_configured_mean_under_the_cap():
    from moe_rl_eks.workloads.rl.data import RandomTokenSource

    cfg = TaskConfig(name="random_tokens", prompt_tokens=256, mean_completion_tokens=2000)
    source = RandomTokenSource(cfg, seed=0, vocab_size=151_936, max_tokens=8192)
    prompts = [source.next() for _ in range(4000)]
    lengths = [p.max_tokens for p in prompts]
    assert all(len(p.prompt_ids) == 256 and max(p.prompt_ids) < 151_936 for p in prompts[:50])
    assert 1900 < sum(lengths) / len(lengths) < 2100 and max(lengths) <= 8192 and min(lengths) >= 140
    assert sum(n > 6000 for n in lengths) > 100  # the tail: ~9 % of a log-uniform [150, 8192] is over 6,000
    assert sorted(lengths)[len(lengths) // 2] < 1500  # median well under the mean
    again = RandomTokenSource(cfg, seed=0, vocab_size=151_936, max_tokens=8192)
    again.restore(source.state())
    assert again.next() == RandomTokenSource(cfg, 0, 151_936, 8192, start=4000).next()  # a resumed run draws the same


def test_random_token_task_must_fit_the_sampling_limits():
    from moe_rl_eks.core.rl_config import RLConfig

    with pytest.raises(ConfigError, match=r"task.mean_completion_tokens.*must be < rl.sampling.max_tokens \(64\)"):
        parse(RLConfig, {"task": {"name": "random_tokens", "mean_completion_tokens": 64},
                         "sampling": {"max_tokens": 64, "max_prompt_tokens": 256}}, source="run")
    with pytest.raises(ConfigError, match=r"task.prompt_tokens.*must be <= rl.sampling.max_prompt_tokens \(16\)"):
        parse(RLConfig, {"task": {"name": "random_tokens", "prompt_tokens": 256, "mean_completion_tokens": 2},
                         "sampling": {"max_tokens": 64, "max_prompt_tokens": 16}}, source="run")
