"""A published version is a complete Hugging Face checkpoint: weights, config.json, tokenizer files and
generation_config.json that transformers loads (same logits, same chat rendering, every EOS id); variants a
Qwen3-MoE loader would run wrongly are labelled so that loaders refuse them."""
import json

import pytest
import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.core.hf_config import VARIANT_MODEL_TYPE
from moe_rl_eks.workloads.model.checkpoint import load_hf, save_hf
from moe_rl_eks.tools.example_data import write_tokenizer_dir
from moe_rl_eks.workloads.rl.tokenizer import (CharTokenizer, load_tokenizer, write_checkpoint_metadata,
                                               write_tokenizer_files)

transformers = pytest.importorskip("transformers")
MESSAGES = [{"role": "user", "content": "Ann has 3 apples and finds 2 more. How many apples does Ann have?"}]


def config(vocab_size: int, **changes) -> ModelConfig:
    fields = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=128, dtype="float32")
    return ModelConfig(**{**fields, **changes})


def test_published_version_loads_in_transformers_with_tokenizer_generation_config_and_same_logits(tmp_path):
    """Through the trainer's path: the Publisher writes a version into the weight store with our files added."""
    from rl_helpers import tiny_run

    from moe_rl_eks.workloads.trainer.publisher import Publisher
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    write_tokenizer_dir(tmp_path / "tok", [m["content"] for m in MESSAGES] * 10, vocab_size=290)
    ours_tok = load_tokenizer(str(tmp_path / "tok"))
    torch.manual_seed(0)
    model = MoETransformer(config(ours_tok.vocab_size)).eval()
    run = tiny_run(tmp_path, sampling={"tokenizer": str(tmp_path / "tok"), "temperature": 0.7})
    store = DirectoryStore(tmp_path / "weights")
    publisher = Publisher(store, model.config, 0, extra_files=lambda d: write_checkpoint_metadata(d, run))
    publisher.publish(1, model.state_dict())
    publisher.flush()
    publisher.close()
    version = store.fetch(1, tmp_path / "cache")

    hf = transformers.AutoModelForCausalLM.from_pretrained(version).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(version)
    gen = transformers.GenerationConfig.from_pretrained(version)
    assert gen.eos_token_id == list(ours_tok.eos_ids) and len(ours_tok.eos_ids) == 2
    assert hf_tok.eos_token_id == ours_tok.eos_id
    prompt = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt == ours_tok.apply_chat_template(MESSAGES, enable_thinking=False)
    ids = torch.tensor([ours_tok.encode(prompt)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=2e-5, rtol=1e-4)
    assert load_tokenizer(str(version)).eos_ids == ours_tok.eos_ids


def test_builtin_vocabulary_is_written_as_a_tokenizer_transformers_reads_alike(tmp_path):
    write_tokenizer_files("builtin", tmp_path, temperature=1.0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    char = CharTokenizer()
    assert hf_tok("12+3=")["input_ids"] == char.encode("12+3=")
    assert hf_tok.decode(char.encode("4*4=16"), skip_special_tokens=True) == "4*4=16"
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == [char.eos_id]
    assert hf_tok.eos_token_id == char.eos_id and hf_tok.bos_token_id == char.bos_id


@pytest.mark.parametrize("variant", [dict(router="sigmoid", n_group=4, topk_group=2), dict(n_shared_experts=1),
                                     dict(router="sigmoid", max_nodes_per_token=1, expert_node_groups=2),
                                     dict(routed_scaling_factor=2.5)])
def test_variants_a_qwen3_moe_loader_cannot_run_are_refused_by_it_and_read_by_ours(tmp_path, variant):
    cfg = config(64, **variant)
    save_hf(MoETransformer(cfg), cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == VARIANT_MODEL_TYPE and written["architectures"] == ["MoeRlEksForCausalLM"]
    assert written["moe_rl_eks"]["not_qwen3_moe"]
    with pytest.raises((ValueError, KeyError), match="moe_rl_eks_moe"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert load_hf(tmp_path)[0] == cfg


def test_a_plain_qwen3_moe_keeps_its_label(tmp_path):
    cfg = config(64)
    save_hf(MoETransformer(cfg), cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and "not_qwen3_moe" not in written["moe_rl_eks"]
