"""The model against transformers' Qwen3-MoE on the same weights, checkpoint round trips, KV cache, padding
and routing replay."""
import json

import pytest
import torch

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers
from moe_rl_eks.workloads.model.checkpoint import CheckpointError, load_hf, load_model, save_hf

transformers = pytest.importorskip("transformers")


def hf_model(norm_topk_prob: bool, tie: bool = False):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def ours_from(directory) -> MoETransformer:
    config, state = load_hf(directory)
    model = MoETransformer(config).eval()
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers_qwen3_moe_on_its_checkpoint(tmp_path, norm_topk_prob):
    hf = hf_model(norm_topk_prob)
    hf.save_pretrained(tmp_path)
    ours = ours_from(tmp_path)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape == (2, 11, 96)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_save_hf_loads_in_transformers_and_back_with_identical_logits(tmp_path, tiny_config):
    model = MoETransformer(tiny_config(tie_word_embeddings=True)).eval()
    save_hf(model, model.config, tmp_path / "ours")
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    again = ours_from(tmp_path / "ours")
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(hf(ids).logits, logits, atol=2e-5, rtol=1e-4)
        assert torch.equal(again(ids).logits, logits)


def test_sharded_checkpoint_has_an_index_and_round_trips_exactly(tmp_path, tiny_config):
    config = tiny_config(router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)
    model = MoETransformer(config)
    model.model.layers[0].mlp.gate.e_score_correction_bias.normal_()
    save_hf(model, config, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in index["weight_map"]
    assert not list(tmp_path.glob(".*.tmp"))
    loaded_config, state = load_hf(tmp_path)
    assert loaded_config == config
    original = model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in original)


def test_reading_one_ranks_experts_reads_that_slice_from_either_expert_layout(tmp_path, tiny_config):
    from safetensors.torch import save_file

    config = tiny_config()
    original = MoETransformer(config).state_dict()
    save_hf(original, config, tmp_path / "per-expert", max_shard_bytes=20_000)
    fused = tmp_path / "fused"  # transformers 5 writes the experts fused, as we hold them
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "per-expert" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in original.items() if k != "lm_head.weight" or not config.tie_word_embeddings},
              fused / "model.safetensors")
    experts = range(2, 4)
    for directory in (tmp_path / "per-expert", fused):
        _, state = load_hf(directory, experts=experts)
        for name, tensor in original.items():
            want = tensor[2:4] if ".mlp.experts." in name else tensor
            assert torch.equal(state[name], want), (directory.name, name)


def test_load_hf_refuses_a_dense_layer_naming_the_field(tmp_path, tiny_config):
    save_hf(MoETransformer(tiny_config()), tiny_config(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["mlp_only_layers"] = [0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        load_hf(tmp_path)


def test_routing_replay_reuses_the_given_experts_and_keeps_router_gradients(tiny_config):
    model = MoETransformer(tiny_config())
    ids = torch.randint(0, 96, (2, 7))
    first = model(ids, return_routing=True)
    assert [r.shape for r in first.routing] == [(2, 7, 2)] * 2
    replayed = model(ids, routing_replay=first.routing, return_routing=True)
    torch.testing.assert_close(replayed.logits, first.logits)
    forced = [torch.zeros_like(r) + torch.tensor([3, 5]) for r in first.routing]
    out = model(ids, routing_replay=forced, return_routing=True)
    assert all(torch.equal(r, f) for r, f in zip(out.routing, forced))
    assert out.expert_load[:, 3].tolist() == [14.0, 14.0] and out.expert_load.sum().item() == 2 * 14 * 2
    out.logits.square().mean().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_is_coefficient_times_mean_layer_balance_loss(tiny_config):
    ids = torch.randint(0, 96, (2, 7))
    assert MoETransformer(tiny_config())(ids).aux_loss.item() == 0.0
    torch.manual_seed(1)
    model = MoETransformer(tiny_config(router_aux_loss_coef=0.1))
    aux = model(ids).aux_loss
    assert aux.requires_grad and 0.1 * 0.5 < aux.item() < 0.1 * 8


def test_load_model_gives_float32_on_cpu_with_the_saved_weights(tmp_path, tiny_config):
    model = MoETransformer(tiny_config(dtype="bfloat16")).eval()
    save_hf(model, model.config, tmp_path)
    loaded = load_model(tmp_path).eval()
    assert loaded.lm_head.weight.dtype == torch.float32
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_shared_experts_add_a_dense_swiglu_to_the_routed_output(tiny_config):
    model = MoETransformer(tiny_config(n_shared_experts=2))
    block = model.model.layers[0].mlp
    assert block.shared_experts.gate_proj.weight.shape == (32, 32)  # 2 x moe_intermediate_size
    x = torch.randn(5, 32)
    with torch.no_grad():
        with_routed = block(x).out
        block.experts.down_proj.zero_()
        shared_only = block(x).out
    torch.testing.assert_close(shared_only, block.shared_experts(x))
    assert not torch.allclose(with_routed, shared_only)


def test_under_bf16_autocast_tokens_reach_the_experts_in_bf16_and_float32_master_weights_get_float32_grads(tiny_config):
    from moe_rl_eks.workloads.moe.dispatch import LocalDispatcher

    seen = []

    class Recorder(LocalDispatcher):  # what a dispatcher (DeepEP moves bf16 only) is handed
        def dispatch(self, x, weights, ids):
            seen.append(x.dtype)
            return super().dispatch(x, weights, ids)

    config = tiny_config()
    model = MoETransformer(config)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    reference = model(ids).logits
    reference.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." in n}
    model.zero_grad()
    for layer in model.model.layers:
        layer.mlp.dispatcher = Recorder(layer.mlp.compute, config.num_experts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    logits.float().square().mean().backward()
    assert seen == [torch.bfloat16] * config.num_hidden_layers
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)
    for name, grad in want.items():
        got = dict(model.named_parameters())[name].grad
        assert got.dtype == torch.float32 and torch.cosine_similarity(got.flatten(), grad.flatten(), 0) > 0.99, name


def test_packed_sequences_equal_each_sequence_alone_forward_and_backward(tiny_config):
    model = MoETransformer(tiny_config())
    lengths = [5, 1, 9, 3]
    seqs = [torch.randint(0, 96, (1, n)) for n in lengths]
    alone = [model(ids, return_routing=True) for ids in seqs]
    sum(o.logits.square().sum() for o in alone).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packed = model(torch.cat(seqs, 1), sequence_lengths=lengths, return_routing=True)
    packed.logits.square().sum().backward()
    torch.testing.assert_close(packed.logits, torch.cat([o.logits for o in alone], 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.hidden, torch.cat([o.hidden for o in alone], 1), atol=1e-5, rtol=1e-5)
    for layer, got in enumerate(packed.routing):  # same experts chosen: positions restart, no cross-attention
        assert torch.equal(got, torch.cat([o.routing[layer] for o in alone], 1))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # replaying the packed routing reproduces the packed forward
    replayed = model(torch.cat(seqs, 1), sequence_lengths=lengths, routing_replay=packed.routing)
    assert torch.equal(replayed.logits, packed.logits)


def test_packing_refuses_lengths_that_do_not_cover_the_row(tiny_config):
    model = MoETransformer(tiny_config())
    with pytest.raises(ValueError, match=r"sequence_lengths \[3, 3\] \(sum 6\) need one packed row of that many "
                                         r"tokens \(got \[1, 7\]\)"):
        model(torch.zeros(1, 7, dtype=torch.long), sequence_lengths=[3, 3])


def test_an_empty_packed_row_runs_and_returns_empty_outputs(tiny_config):
    model = MoETransformer(tiny_config())
    out = model(torch.zeros(1, 0, dtype=torch.long), sequence_lengths=[], logits=False)
    assert out.logits is None and out.hidden.shape == (1, 0, 32)
    assert out.expert_load.sum() == 0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["full", "save_attention"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(tiny_config, packed, mode):
    model = MoETransformer(tiny_config(router_aux_loss_coef=0.01))
    ids = torch.randint(0, 96, (1, 12) if packed else (2, 6))
    kwargs = {"sequence_lengths": [7, 5]} if packed else {}
    results = []
    for on in ("off", mode):
        model.zero_grad()
        checkpoint_layers(model, on)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = model(ids, **kwargs)
        loss = out.logits.square().mean() + out.aux_loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)))
    (loss_off, grads_off, saved_off), (loss_on, grads_on, saved_on) = results
    assert torch.equal(loss_on, loss_off)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert saved_on < saved_off / 2  # the layers keep their inputs, not their activations
    with pytest.raises(ValueError, match="activation_checkpointing True is not one of"):
        checkpoint_layers(model, True)
