"""A Hugging Face `config.json` and our ModelConfig, both ways, torch-free: the checkpoint loader and writer
(workloads/model/checkpoint.py), `moerl serve-rollout --model DIR` and `moerl plan --model DIR` read it here."""
from __future__ import annotations

from .run import ModelConfig
from .schema import parse

# Our router options beyond Qwen3-MoE go under this key of config.json (Hugging Face keeps unknown keys).
EXTRA_KEY = "moe_rl_eks"
EXTRA_FIELDS = ("router", "n_group", "topk_group", "routed_scaling_factor", "max_nodes_per_token",
                "expert_node_groups", "n_shared_experts")
QWEN3_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "router_aux_loss_coef")


class CheckpointError(ValueError):
    pass


# A variant that a Qwen3-MoE loader would run wrongly (it would route with a softmax and ignore the rest) is
# written under its own model_type and architecture, so transformers, vLLM and SGLang refuse it ("unrecognized
# model type / architecture") instead of silently loading it as qwen3_moe. Our loader reads both.
VARIANT_MODEL_TYPE = "moe_rl_eks_moe"
VARIANT_ARCHITECTURE = "MoeRlEksForCausalLM"


def qwen3_incompatibilities(config: ModelConfig) -> list[str]:
    """What of `config` a Qwen3-MoE implementation does not compute; empty for a plain Qwen3-MoE."""
    found = []
    if config.router != "softmax":
        found.append(f"router: {config.router} (scores, selection bias, group-limited top-k)")
    if config.n_shared_experts:
        found.append(f"n_shared_experts: {config.n_shared_experts}")
    if config.max_nodes_per_token is not None:
        found.append(f"max_nodes_per_token: {config.max_nodes_per_token} (node-limited routing)")
    if config.routed_scaling_factor != 1.0:
        found.append(f"routed_scaling_factor: {config.routed_scaling_factor}")
    return found


def hf_config(config: ModelConfig) -> dict:
    out = {name: getattr(config, name) for name in QWEN3_FIELDS}
    out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
               attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
               intermediate_size=config.moe_intermediate_size, dtype=config.dtype,
               rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
               rope_theta=config.rope_theta)
    out[EXTRA_KEY] = {name: getattr(config, name) for name in EXTRA_FIELDS}
    variant = qwen3_incompatibilities(config)
    if variant:
        out.update(architectures=[VARIANT_ARCHITECTURE], model_type=VARIANT_MODEL_TYPE)
        out[EXTRA_KEY]["not_qwen3_moe"] = variant  # says to a reader why the file is not labelled qwen3_moe
    return out


def model_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json mapping; refuses what this model cannot run."""
    def need(cond: bool, field: str, allowed: str) -> None:
        if not cond:
            raise CheckpointError(f"{source}: {field}: {hf.get(field)!r} is not supported; {allowed}")

    need(hf.get("model_type") in ("qwen3_moe", VARIANT_MODEL_TYPE), "model_type",
         f"expected 'qwen3_moe' or {VARIANT_MODEL_TYPE!r} (our variants of it)")
    need(hf.get("decoder_sparse_step", 1) == 1, "decoder_sparse_step", "every layer must be MoE (1)")
    need(not hf.get("mlp_only_layers"), "mlp_only_layers", "dense layers are not supported (expected [])")
    need(not hf.get("attention_bias", False), "attention_bias", "expected false")
    need(hf.get("hidden_act", "silu") == "silu", "hidden_act", "expected 'silu'")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: rope_parameters.rope_type: {rope['rope_type']!r} is not supported; "
                              "expected 'default'")
    fields = {name: hf[name] for name in QWEN3_FIELDS if name in hf and name != "num_experts"}
    fields["num_experts"] = hf.get("num_experts", hf.get("num_local_experts"))
    fields["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", ModelConfig.rope_theta)))
    fields.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if hf.get("dtype", hf.get("torch_dtype")) in ("float32", "bfloat16"):
        fields["dtype"] = hf.get("dtype", hf.get("torch_dtype"))
    fields.update({k: v for k, v in hf.get(EXTRA_KEY, {}).items() if k in EXTRA_FIELDS})
    return parse(ModelConfig, fields, source=source)


