"""Continuous-batching decoding: a group's rows share one prefill, rows join and leave at every step, and every
row samples exactly as it would alone; the sampler's filters, logprob modes and counter-based seeds."""
import numpy as np
import pytest
import torch
from rl_helpers import DEVICES

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rollout import sampler
from moe_rl_eks.workloads.rollout.decoder import Decoder, decode_all
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.model_runner import ModelRunner, PackedAttention
from moe_rl_eks.workloads.rollout.sampler import SamplingRows, philox4x32, sample

EOS = 2


@pytest.mark.parametrize("device", DEVICES)
def test_rows_share_a_prefill_finished_rows_leave_the_batch_and_each_samples_as_it_would_alone(model, device,
                                                                                                 monkeypatch):
    model = model.to(device)
    # one prompt's group with uneven lengths (rows stop early as at end-of-sequence), and another prompt
    group = [request([1, 6, 13, 7, 16], n, seed, row=seed, return_routing=True) for seed, n in enumerate([6, 1, 1, 2])]
    other = [request([1, 9, 13, 9, 16, 4], 4, 11, row=4, return_routing=True, temperature=0.7, top_p=0.9)]
    fed = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda runner, slot, tokens, *a, **kw: fed.append(tokens.shape)
                        or forward(runner, slot, tokens, *a, **kw))
    together = decode_all(model, group + other, [EOS])
    if device == "cpu":  # on a GPU, decode steps replay CUDA graphs (captured with padding rows) instead
        assert fed[0] == (11,)  # two distinct prompts prefilled once each, packed: 5 + 6 tokens, no padding
        decode = [shape[0] for shape in fed[1:]]
        assert decode[0] == 3 and decode == sorted(decode, reverse=True) and decode[-1] == 1, decode  # rows left
    for row, got in zip(group + other, together):
        (alone,) = decode_all(model, [row], [EOS])
        assert got.token_ids == alone.token_ids and np.array_equal(got.routing, alone.routing)
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert len(got.routing) == len(row.prompt_ids) + len(got.token_ids) - 1
    assert len({tuple(r.token_ids[:1]) for r in together[:4]}) > 1  # the group's seeds still give different samples


def request(prompt, max_tokens, seed, row=0, **params):
    return RowRequest(tuple(prompt), SamplingParams(max_tokens, seed=seed, **params), "r", row)


def run_to_end(decoder: Decoder, seqs, joining=()):
    """Step until every row finished; `joining` = (step, request) pairs added while others run."""
    joining, step = list(joining), 0
    while decoder.busy or joining:
        while joining and joining[0][0] == step:
            seqs.append(decoder.add(joining.pop(0)[1]))
        decoder.step()
        step += 1
    return seqs


def test_rows_joining_mid_decode_and_chunked_prefills_sample_as_they_would_alone(model):
    # two slots for three rows: the third waits for a free slot; a long prompt prefills 3 tokens per step
    # while the other row decodes
    rows = [request([1, 5, 6], 6, 1, return_routing=True),
            request([1, 7, 8, 9, 10, 11, 12, 13], 3, 2, return_routing=True, top_k=5),
            request([1, 4], 2, 3, return_routing=True, temperature=0.0)]
    decoder = Decoder(model, slots=2, max_len=16, eos_ids=[EOS], prefill_tokens=3)
    seqs = run_to_end(decoder, [decoder.add(rows[0])], joining=[(2, rows[1]), (3, rows[2])])
    assert sorted(decoder.scheduler.free) == [0, 1]  # every slot came back
    for seq, row in zip(seqs, rows):
        alone = Decoder(model, slots=1, max_len=16, eos_ids=[EOS])
        (ref,) = run_to_end(alone, [alone.add(row)])
        assert seq.tokens == ref.tokens and torch.equal(seq.routing, ref.routing)
        assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def assert_scored_and_routed_as_the_trainers_forward(model, seq):
    """A raw-logprob row's logprobs and routing equal the model's own forward of its prompt and completion."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(seq.prompt) + seq.tokens], device=device)
    with torch.no_grad():
        out = model(ids, return_routing=True)
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1).cpu()
    want = logp[len(seq.prompt) - 1:].gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
    assert seq.logprobs == pytest.approx(want.tolist(), abs=1e-5)
    routing = torch.stack(out.routing, 2)[0, :-1].cpu()  # [positions fed, layers, k]
    assert torch.equal(seq.routing.long().cpu(), routing) and seq.routing.dtype == torch.uint8


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_forward_scores_and_routes_tokens_as_the_trainers_forward_does(model, device):
    model = model.to(device)
    row = request([1, 6, 13, 7, 16], 6, 5, return_routing=True, logprob_mode="raw")
    decoder = Decoder(model, slots=2, max_len=16, eos_ids=[99])
    (seq,) = run_to_end(decoder, [decoder.add(row)])
    assert_scored_and_routed_as_the_trainers_forward(model, seq)


def test_rows_of_a_crowded_decoder_are_scored_and_routed_as_the_trainers_forward_does(model):
    # everything the scheduler does at once: a group sharing a prefill and its prompt's blocks, chunked prefills
    # beside decode steps, rows joining mid-decode, too few blocks (preemption and recomputation), filtered rows.
    # (On the CPU: a GPU's kernels reduce in another order, and over this many positions a near-tie in routing
    # may flip; the single-row test above pins the GPU path.)
    shared = [1, 6, 13, 7, 16, 9, 4]
    rows = [request(shared, 9, i, row=i, return_routing=True, logprob_mode="raw", top_k=8 * i) for i in range(3)]
    rows.append(request([1, 9, 13, 9, 16, 4, 5, 6, 7, 8, 10], 6, 7, row=3, return_routing=True,
                        logprob_mode="raw", top_p=0.8))
    joining = [(2, request([1, 4, 5], 8, 8, row=4, return_routing=True, logprob_mode="raw", min_p=0.1)),
               (3, request(shared, 5, 9, row=5, return_routing=True, logprob_mode="raw"))]
    decoder = Decoder(model, slots=4, max_len=20, eos_ids=[99], prefill_tokens=5, block_size=4, blocks=11)
    seqs = run_to_end(decoder, [decoder.add(r) for r in rows], joining=joining)
    assert decoder.stats()["preemptions"] >= 1
    for seq in seqs:
        assert_scored_and_routed_as_the_trainers_forward(model, seq)


def test_prompt_logprobs_come_from_the_chunked_prefill_and_equal_a_plain_forwards(model):
    prompt = [1, 6, 13, 7, 16, 9, 4, 11]
    decoder = Decoder(model, slots=4, max_len=16, eos_ids=[99], prefill_tokens=3)  # the prompt takes 3 chunks
    scored = [request(prompt, 2, 5, row=i, prompt_logprobs=True, top_logprobs=3, temperature=0.7) for i in range(2)]
    plain = request([1, 9, 13], 2, 6, row=2)
    seqs = run_to_end(decoder, [decoder.add(r) for r in [*scored, plain]])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)  # the model's own
    want = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for seq in seqs[:2]:  # both rows of the group, one prefill
        assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
        assert seq.prompt_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-5)
        values, ids = logp.topk(3, -1)
        assert seq.prompt_top_logprobs[0] is None
        for got, i, v in zip(seq.prompt_top_logprobs[1:], ids.tolist(), values.tolist()):
            assert [t for t, _ in got] == i and [lp for _, lp in got] == pytest.approx(v, abs=1e-5)
    assert seqs[2].prompt_logprobs is None and seqs[2].prompt_top_logprobs is None
    alone = run_to_end(decoder, [decoder.add(request(prompt, 2, 5, row=0, temperature=0.7))])  # not scored
    assert alone[0].tokens == seqs[0].tokens


def test_philox_matches_random123s_known_answers_and_a_row_draw_depends_only_on_seed_row_and_step():
    zero, ones = torch.zeros(1, dtype=torch.long), torch.full((1,), 0xFFFFFFFF)
    assert [int(w) for w in philox4x32((zero,) * 4, (zero, zero))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
                                                                        0x9B00DBD8]
    assert [int(w) for w in philox4x32((ones,) * 4, (ones, ones))] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                                        0x6D5451FD]
    u = sampler.row_uniform(torch.tensor([7, 7, 7, 8]), torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, 0, 0]),
                               torch.tensor([0, 0, 1, 0]))
    assert len(set(u.tolist())) == 4 and all(0 <= x < 1 for x in u.tolist())
    again = sampler.row_uniform(torch.tensor([7]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    assert again.item() == u[1].item()
    # the CPU's numpy path and the GPU's tensor path are one function: the same words from the same counters
    big = torch.tensor([2 ** 32 - 1, 5, 2 ** 40 + 3])
    words = philox4x32((big & 0xFFFFFFFF, big % 7, big >> 32, big * 0), (big % 11, big & 0xFFFF))[0]
    uniform = sampler.row_uniform(big % 11, big & 0xFFFF, big % 7, big)
    assert uniform.tolist() == ((words >> 8).float() / (1 << 24)).tolist()


def rows_of(params: list[SamplingParams], seeds) -> SamplingRows:
    def col(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype)
    return SamplingRows(col([p.temperature for p in params]), col([p.top_p for p in params]),
                        col([p.top_k for p in params], torch.long), col([p.min_p for p in params]),
                        col([p.logprob_mode == "raw" for p in params], torch.bool), col(seeds, torch.long),
                        col([0] * len(params), torch.long), col([0] * len(params), torch.long),
                        col([0] * len(params), torch.long), filtered=True, any_raw=True, top_n=2)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_follows_the_processed_distribution_and_reports_processed_or_raw_logprobs(device):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = [SamplingParams(1), SamplingParams(1, top_p=0.7), SamplingParams(1, top_k=1),
              SamplingParams(1, min_p=0.5, logprob_mode="raw"), SamplingParams(1, temperature=0.0),
              SamplingParams(1, temperature=0.5, top_k=3)]
    logits = torch.log(probs).repeat(len(params), 1).to(device)
    counts = torch.zeros(len(params), 4)
    for draw in range(3000):
        rows = rows_of(params, [0] * len(params))
        rows.step = torch.full((len(params),), draw, dtype=torch.long)
        out = sample(logits, rows.__class__(**{k: v.to(device) if torch.is_tensor(v) else v
                                             for k, v in vars(rows).items()}))
        counts[torch.arange(len(params)), out.tokens.cpu()] += 1
        if draw == 0:
            lp = out.logprobs.cpu()
            assert lp[1].item() == pytest.approx(float(torch.log(probs[0] / 0.8)), abs=1e-5) or \
                lp[1].item() == pytest.approx(float(torch.log(probs[1] / 0.8)), abs=1e-5)
            assert lp[2].item() == pytest.approx(0.0, abs=1e-6)  # top-1 keeps one token: probability 1
            assert lp[3].item() == pytest.approx(float(torch.log(probs[out.tokens[3].item()])), abs=1e-5)  # raw
            assert out.top_ids[4].tolist() == [0, 1] and out.top_logprobs[2, 1].item() == float("-inf")
    freq = (counts / counts.sum(1, keepdim=True)).tolist()
    sharp = torch.tensor([0.5, 0.3, 0.15]) ** 2
    assert freq[0] == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)
    assert freq[1] == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.03)  # top-p 0.7 keeps 0.5 + 0.3
    assert freq[2] == [1.0, 0.0, 0.0, 0.0]
    assert freq[3] == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.03)  # min-p 0.5: p >= 0.25
    assert freq[4] == [1.0, 0.0, 0.0, 0.0]  # greedy
    assert freq[5] == pytest.approx((sharp / sharp.sum()).tolist() + [0.0], abs=0.03)  # temperature 0.5, top-3


def test_the_generation_benchmark_prints_its_table(capsys):
    from moe_rl_eks.tools.bench.generation import main

    assert main(["--group", "2", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1",
                 "--tail-tokens", "6", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| 4 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["2 distinct", "1 shared"]
    # 8 rows (6, 2, 2, 2, 6, 2, 2, 2 new tokens) through 2 slots; a step feeds every row one token, the prefill's
    # step two (its first token is sampled from the prompt). Batch by batch: 5 + 1 + 5 + 1 steps; continuously fewer
    # (the short rows fill the slot beside each long one)
    steps = {line.split("|")[1].strip().split(" ")[0]: int(line.split("|")[2]) for line in out
             if line.startswith(("| batch by batch", "| continuous"))}
    assert steps["batch"] == 12 and steps["continuous"] < 12, steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_steps_replayed_from_cuda_graphs_equal_eager_decoding(model):
    model = model.cuda().bfloat16()  # bf16: the torch backend's experts are one grouped GEMM, capturable
    rows = [request([1, 5, 6], 5, 1, return_routing=True), request([1, 7, 8, 9], 4, 2, top_p=0.8),
            request([1, 4], 5, 3, temperature=0.0)]
    outs = {}
    for graphs in (True, False):
        decoder = Decoder(model, slots=3, max_len=16, eos_ids=[EOS], cuda_graphs=graphs)
        assert sorted(decoder.runner.graphs) == ([1, 2, 3] if graphs else [])
        outs[graphs] = run_to_end(decoder, [decoder.add(rows[0])], joining=[(1, rows[1]), (2, rows[2])])
    for a, b in zip(outs[True], outs[False]):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert torch.equal(outs[True][0].routing, outs[False][0].routing)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_kernels_sample_each_row_as_alone_and_as_the_torch_backend(model, monkeypatch):
    from moe_rl_eks.kernels import backend

    model = model.cuda()
    triton_model = MoETransformer(model.config, compute="triton").eval().cuda()
    triton_model.load_state_dict(model.state_dict())
    calls = []
    kernels = backend.decode_experts
    monkeypatch.setattr(backend, "decode_experts", lambda *a: calls.append(a[0].shape[0]) or kernels(*a))
    # prompts short enough that the shared prefill (3 + 4 tokens) also fits the decode kernels (<= 8 tokens): the
    # grouped GEMM beyond them is bf16-only on a GPU, and this model is float32
    rows = [request([1, 6, 13], n, seed, row=seed, return_routing=True) for seed, n in enumerate([6, 1, 2])]
    rows.append(request([1, 9, 13, 9], 4, 11, row=3, return_routing=True, temperature=0.7, top_p=0.9))
    together = decode_all(triton_model, rows, [EOS])
    assert calls and max(calls) <= backend.DECODE_MAX_TOKENS  # every MoE layer went through the decode kernels
    for row, got, want in zip(rows, together, decode_all(model, rows, [EOS])):
        (alone,) = decode_all(triton_model, [row], [EOS])
        assert got.token_ids == alone.token_ids == want.token_ids
        assert np.array_equal(got.routing, alone.routing) and np.array_equal(got.routing, want.routing)
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_the_runners_packed_qkv_weights_are_the_models_and_follow_a_weight_install(model):
    from moe_rl_eks.workloads.rollout.weight_staging import install

    packed = PackedAttention(model)
    attn = model.model.layers[1].self_attn
    assert torch.equal(packed.qkv[1], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(packed.qk_norm[1], torch.stack([attn.q_norm.weight, attn.k_norm.weight]))
    buffers = [b.data_ptr() for b in packed.qkv + packed.qk_norm]
    state = {name: t * 2 if name.endswith(("k_proj.weight", "q_norm.weight")) else t
             for name, t in model.state_dict().items()}
    install(model, state)  # in place, as a served version arrives
    packed.load(model)
    assert torch.equal(packed.qkv[1][attn.heads * attn.head_dim:][:attn.kv_heads * attn.head_dim],
                       state["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(packed.qk_norm[1][0], state["model.layers.1.self_attn.q_norm.weight"])
    assert [b.data_ptr() for b in packed.qkv + packed.qk_norm] == buffers  # refreshed in place: graphs stay valid


def test_the_rollout_benchmark_prints_its_table(capsys, tmp_path):
    from moe_rl_eks.tools.bench.rollout import main

    assert main(["--tiny", "--batches", "1", "3", "--prompt-tokens", "5", "--new-tokens", "3", "--compute", "torch",
                 "--mismatch-layers", "1", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:4] for line in out.splitlines() if line.startswith("| torch |")]
    assert [[c.strip() for c in r] for r in rows] == [["torch", "1", "5"], ["torch", "3", "5"]]
    assert "logprob mismatch, engine vs trainer forward (1 layers, 128 tokens)" in out


def test_greedy_decoding_equals_transformers_generate_on_its_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moe_rl_eks.workloads.model.checkpoint import load_hf

    torch.manual_seed(3)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)  # sharper logits: no near-ties for float rounding to flip
    hf.save_pretrained(tmp_path)
    config, state = load_hf(tmp_path)
    ours = MoETransformer(config).eval()
    ours.load_state_dict(state)
    prompts = [[5, 17, 33, 2, 9], [40, 41]]
    decoder = Decoder(ours, slots=2, max_len=32, eos_ids=[95])
    seqs = run_to_end(decoder, [decoder.add(request(p, 12, 0, i, temperature=0.0)) for i, p in enumerate(prompts)])
    for p, seq in zip(prompts, seqs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=95, pad_token_id=0)
        assert seq.tokens == want[0, len(p):].tolist()


def alone(model, row, **sizes):
    decoder = Decoder(model, slots=1, max_len=32, eos_ids=[EOS], **sizes)
    (seq,) = run_to_end(decoder, [decoder.add(row)])
    return seq


def assert_same(seq, ref):
    assert seq.tokens == ref.tokens and torch.equal(seq.routing, ref.routing)
    assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_groups_rows_share_the_prompts_full_blocks_copy_the_partial_one_and_return_every_block(model, device):
    model = model.to(device)
    prompt = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 10 tokens: two full blocks of 4 and a partial one
    rows = [request(prompt, n, seed, row=seed, return_routing=True) for seed, n in enumerate([7, 3, 5])]
    decoder = Decoder(model, slots=3, max_len=24, eos_ids=[99], block_size=4)
    seqs = [decoder.add(r) for r in rows]
    decoder.step()  # admission and the group's one prefill
    owned = [decoder.scheduler.cache.owned[s.slot] for s in seqs]
    assert owned[1][:2] == owned[2][:2] == owned[0][:2]  # the full blocks, shared
    assert len({o[2] for o in owned}) == 3  # the partial block, one copy per row
    assert [decoder.scheduler.cache.refs[b] for b in owned[0]] == [3, 3, 1]
    assert decoder.stats()["blocks_used"] == 5  # not 3 x 3 as separate prefills would hold
    run_to_end(decoder, seqs)
    assert decoder.stats()["blocks_free"] == decoder.stats()["blocks_total"] and not any(decoder.scheduler.cache.refs)
    for seq, row in zip(seqs, rows):
        assert_same(seq, alone(model, row))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_wait_for_blocks_and_the_newest_decoding_row_is_preempted_then_recomputed_exactly(model, device):
    model = model.to(device)
    # 7 blocks of 4 positions for 4 rows of 5 prompt + 8 new tokens (up to 3 blocks each): the fourth row waits for
    # blocks although a slot is free; when the running rows cross into their third block there are not enough,
    # so the newest are preempted, recomputed later, and still sample exactly what they would alone
    rows = [request([1, 5 + i, 6, 7, 8], 8, i, row=i, return_routing=True, top_p=0.9) for i in range(4)]
    decoder = Decoder(model, slots=4, max_len=16, eos_ids=[99], block_size=4, blocks=7)
    seqs = [decoder.add(r) for r in rows]
    decoder.step()
    assert [s.slot is None for s in seqs] == [False, False, False, True] and decoder.scheduler.free
    assert decoder.stats()["blocks_free"] == 1
    run_to_end(decoder, seqs)
    preemptions = decoder.stats()["preemptions"]
    assert preemptions >= 1 and [s.preempted > 0 for s in seqs].count(True) >= 1
    assert decoder.take_preemptions() == preemptions and decoder.take_preemptions() == 0
    assert seqs[2].preempted and not seqs[0].preempted  # the newest decoding row goes first, never the oldest
    assert decoder.stats()["blocks_free"] == 7
    for seq, row in zip(seqs, rows):
        assert len(seq.tokens) == 8 and seq.finish_reason == "length"
        assert_same(seq, alone(model, row))


def test_a_cancelled_row_returns_its_blocks_and_a_row_that_can_never_fit_is_refused(model):
    decoder = Decoder(model, slots=2, max_len=16, eos_ids=[99], block_size=4, blocks=5)
    with pytest.raises(ValueError, match=r"^max_tokens: 12 with 5 prompt tokens needs 5 KV-cache blocks"):
        Decoder(model, slots=2, max_len=24, eos_ids=[99], block_size=4, blocks=4).add(request([1, 2, 3, 4, 5], 12, 0))
    doomed, kept = decoder.add(request([1, 2, 3, 4, 5], 10, 0)), decoder.add(request([1, 7], 6, 1, row=1))
    for _ in range(2):
        decoder.step()
    held = len(decoder.scheduler.cache.owned[doomed.slot])
    assert held == 2 and decoder.stats()["blocks_used"] == 3
    assert decoder.cancel(doomed) and doomed.finish_reason == "abort"
    assert decoder.stats()["blocks_used"] == 1
    run_to_end(decoder, [kept])
    assert decoder.stats()["blocks_free"] == 5 and kept.finish_reason == "length"


def test_ignore_eos_runs_a_row_to_its_max_tokens_through_the_models_eos_ids(model):
    # every id is an end-of-sequence id: a row stops at its first token, unless it ignores them (vLLM's ignore_eos);
    # its own stop_token_ids still stop it
    every = range(model.config.vocab_size)
    stopped, ignoring, stop_id = decode_all(model, [request([1, 6, 13], 9, 0), request([1, 6, 13], 9, 0, ignore_eos=True),
                                                    request([1, 6, 13], 9, 0, ignore_eos=True,
                                                            stop_token_ids=tuple(every))], every)
    assert (len(stopped.token_ids), stopped.finish_reason) == (1, "stop")
    assert (len(ignoring.token_ids), ignoring.finish_reason) == (9, "length")
    assert (len(stop_id.token_ids), stop_id.finish_reason) == (1, "stop")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(4, ignore_eos=1)
