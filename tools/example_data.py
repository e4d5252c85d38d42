"""`moerl example-data`: the local real-data example, made here instead of downloaded. Writes a Hugging Face
style tokenizer directory (a byte-level BPE trained on the problems as rendered through the chat template, a
ChatML chat template with a thinking switch as Qwen3 has, tokenizer_config.json and generation_config.json with
two stop ids) and train/eval Parquet files of generated word problems in verl's column layout (prompt as chat
messages, data_source, reward_model.ground_truth, extra_info)."""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# ChatML as Qwen3 uses it: each turn is <|im_start|>role\n...<|im_end|>\n; with enable_thinking=false the
# assistant turn starts with an empty think block, so the model answers directly.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
SYSTEM = "Answer with the number only."
NAMES = ("Ann", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana")
THINGS = ("apples", "books", "coins", "shells", "stamps", "cards")


def word_problem(rng: random.Random, max_operand: int) -> tuple[str, int, str]:
    """(question, answer, kind): addition, subtraction without negatives, or multiplication."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        return f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have?", a + b, kind
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {thing} and gives {b} away. How many {thing} are left?", a - b, kind
    return f"{name} fills {a} bags with {b} {thing} each. How many {thing} is that?", a * b, kind


def problems(count: int, seed: int, max_operand: int, split: str) -> list[dict]:
    rng = random.Random(f"{split}:{seed}")
    rows = []
    for i in range(count):
        question, answer, kind = word_problem(rng, max_operand)
        rows.append({"data_source": "word_problems",
                     "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(answer)},
                     "extra_info": {"split": split, "index": i, "kind": kind}})
    return rows


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer_dir(directory: Path, texts: list[str], vocab_size: int = 448) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, eos <|im_end|>) + generation_config.json listing
    both stop ids, as a Qwen3 checkpoint has them."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, vocab_size)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "chat_template": CHAT_TEMPLATE,
              "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False,
                                                "lstrip": False, "rstrip": False, "single_word": False}
                                       for t, i in ids.items()}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
                  "bos_token_id": None, "do_sample": True, "temperature": 1.0}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def conversations(rows: list[dict]) -> list[str]:
    """The training rows as the model sees them: each prompt rendered through the chat template, the answer
    after it (the tokenizer learns the template's own text, so role names and markers are whole tokens)."""
    from moe_rl_eks.workloads.rl.tokenizer import compile_chat_template

    template = compile_chat_template(CHAT_TEMPLATE)
    return [template.render(messages=r["prompt"], add_generation_prompt=True, enable_thinking=False)
            + r["reward_model"]["ground_truth"] for r in rows]


def write_example(out: Path, *, train: int = 2000, eval_: int = 128, seed: int = 0, max_operand: int = 4,
                  vocab_size: int = 448) -> None:
    train_rows, eval_rows = problems(train, seed, max_operand, "train"), problems(eval_, seed, max_operand, "eval")
    corpus = conversations(train_rows)
    write_tokenizer_dir(out / "tokenizer", corpus, vocab_size)
    write_parquet(train_rows, out / "train.parquet")
    write_parquet(eval_rows, out / "eval.parquet")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl example-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for tokenizer/, train.parquet, eval.parquet")
    parser.add_argument("--train", type=int, default=2000, help="training problems")
    parser.add_argument("--eval", type=int, default=128, help="evaluation problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=4)
    args = parser.parse_args(argv)
    write_example(Path(args.out), train=args.train, eval_=args.eval, seed=args.seed, max_operand=args.max_operand)
    print(f"wrote {args.out}/tokenizer, {args.out}/train.parquet ({args.train}), {args.out}/eval.parquet ({args.eval})")
    return 0
