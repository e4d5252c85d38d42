"""What each rank of an expert-parallel server does in test_deepep_ll_gpu.py (a module of its own so spawned
workers can unpickle it): decode its share of the rows with its own continuous-batching Decoder, once with
DeepEP's low-latency kernels for the decode forwards and once with the all-to-all, and run one MoE layer both
ways; rank 0 also decodes every row in one single-GPU Decoder (all experts, CUDA graphs, the experts through the
grouped kernels a rank uses), the reference.
`phases_seen` (test_deepep_ll.py, CPU) records which side of the phased dispatcher each forward reaches."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import cast_for_serving
from moe_rl_eks.workloads.moe import deepep_ll
from moe_rl_eks.workloads.moe.parallel import ExpertParallel
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.decoder import Decoder, decode_all

# DeepEP's low-latency kernels take hidden sizes 2048..8192 only; the rest is small.
CONFIG = ModelConfig(vocab_size=512, hidden_size=2048, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, moe_intermediate_size=256, num_experts=16,
                     num_experts_per_tok=4, rope_theta=10000.0, max_position_embeddings=256, dtype="bfloat16")
SLOTS = 4  # decode rows per rank: DeepEP's fixed tokens per rank


def requests() -> list[list[RowRequest]]:
    """Rows per rank, uneven (rank 1 runs out first and then feeds scratch tokens): a group of two sharing a
    prompt, greedy and sampled rows, different prompt lengths."""
    def row(prompt, rid, i, **params):
        return RowRequest(tuple(prompt), SamplingParams(**{"max_tokens": 12, **params}), rid, i)
    shared = [5, 17, 3, 99, 42]
    return [[row(shared, "group", 0, temperature=1.0, seed=11), row(shared, "group", 1, temperature=1.0, seed=11),
             row([7, 8, 9], "greedy", 0, temperature=0.0)],
            [row([300, 2, 1, 77, 6, 410, 9], "sampled", 0, temperature=0.8, top_p=0.9, seed=5, max_tokens=6)]]


def full_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """One set of weights for every rank and the reference; the lm_head spread like a trained model's logits
    (a few units apart), so bf16 rounding differences cannot tie the argmax."""
    torch.manual_seed(0)
    state = MoETransformer(config).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] * 5
    return state


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU runs the all-to-all half (a check of this file)


def serving_model(config: ModelConfig, state, ep: ExpertParallel | None, compute: str) -> MoETransformer:
    model = cast_for_serving(MoETransformer(config, ep=ep, compute=compute), torch.bfloat16).to(DEVICE)
    model.load_full_state_dict(state)
    return model.eval()


class GroupedExperts:
    """A compute backend whose fused single-rank decode op (`decode`) declines every step: the reference then runs
    a decode step's experts through the same grouped kernels a rank runs after a dispatch, so a difference from
    the sharded rows is the dispatch's and combine's. (The fused op against the grouped path:
    tests/kernels/test_expert_decode.py.)"""

    def __init__(self, inner) -> None:
        self._inner = inner

    def decode(self, *args, **kwargs) -> None:
        return None  # MoECompute.decode's "no faster path here"

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _any(flag: bool) -> bool:
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value)


def _gather(obj, world):
    parts = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


def decode_sharded(model: MoETransformer, rows: list[RowRequest], world: int) -> dict:
    """This rank's rows through its own Decoder, every rank stepping together; every rank's rows, gathered."""
    decoder = Decoder(model, slots=SLOTS, max_len=64, eos_ids=())
    seqs = [decoder.add(r) for r in rows]
    while _any(decoder.busy):
        decoder.step(agree=_any)
    mine = {(s.request.request_id, s.request.row): (s.tokens, s.logprobs) for s in seqs}
    return {k: v for part in _gather(mine, world) for k, v in part.items()}


def serve_both_ways(rank: int, world: int, compute: str, decodes=("deepep_ll", "alltoall")) -> dict:
    state = full_weights(CONFIG)
    calls = {"ll_dispatch": 0}
    dispatch = deepep_ll.DeepEPLowLatencyDispatcher.dispatch

    def counted(self, x, weights, ids):
        calls["ll_dispatch"] += 1
        return dispatch(self, x, weights, ids)

    deepep_ll.DeepEPLowLatencyDispatcher.dispatch = counted
    result: dict = {}
    models = {}
    for decode in decodes:
        ep = ExpertParallel(dist.group.WORLD, "alltoall", device=DEVICE, decode=decode, decode_rows_per_rank=SLOTS)
        models[decode] = serving_model(CONFIG, state, ep, compute)
        with torch.no_grad():
            result[decode] = decode_sharded(models[decode], requests()[rank], world)
    result["ll_dispatches"] = _gather(calls["ll_dispatch"], world)

    # One MoE layer on the same tokens: low-latency decode dispatch, all-to-all, one GPU with every expert.
    x = torch.randn(SLOTS - rank, CONFIG.hidden_size, generator=torch.Generator().manual_seed(rank)).to(
        DEVICE, torch.bfloat16)
    layer = {}
    with torch.no_grad():
        for decode, model in models.items():
            with model.ep.decode_phase():
                layer[decode] = model.model.layers[0].mlp(x, statistics=False).out.cpu()
    result["layer"] = {k: torch.cat(_gather(v, world)) for k, v in layer.items()}
    xs = torch.cat(_gather(x.cpu(), world))
    if rank == 0:
        single = serving_model(CONFIG, state, None, compute)
        for layer in single.model.layers:
            layer.mlp.compute = GroupedExperts(layer.mlp.compute)
        with torch.no_grad():
            result["layer"]["single"] = single.model.layers[0].mlp(xs.to(DEVICE), statistics=False).out.cpu()
            outs = decode_all(single, [r for part in requests() for r in part], eos_ids=())
        result["single"] = {(o.request_id, o.row): (o.token_ids, o.logprobs) for o in outs}
    return result


def phases_seen(rank: int, world: int) -> dict:
    """Which dispatcher a sharded Decoder's forwards reach (CPU, all-to-all both ways): every layer's dispatcher is
    a PhasedDispatcher whose two sides record the tokens of each call."""
    from moe_rl_eks.workloads.moe.dispatch import AllToAllDispatcher, PhasedDispatcher

    config = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8,
                         num_experts_per_tok=2, rope_theta=10000.0, dtype="float32")
    torch.manual_seed(0)
    ep = ExpertParallel(dist.group.WORLD, "alltoall")
    model = MoETransformer(config, ep=ep).eval()
    seen = {"prefill": [], "decode": []}

    class Recorded(AllToAllDispatcher):
        def __init__(self, phase):
            super().__init__(model.compute, config.num_experts, dist.group.WORLD)
            self.phase = phase

        def dispatch(self, x, weights, ids):
            seen[self.phase].append(x.shape[0])
            return super().dispatch(x, weights, ids)

    for layer in model.model.layers:
        layer.mlp.dispatcher = PhasedDispatcher(ep, Recorded("prefill"), Recorded("decode"))
    with torch.no_grad():
        rows = decode_sharded(model, requests()[rank], world)
    return {"rows": rows, "seen": _gather(seen, world)}
