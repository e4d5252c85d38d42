"""The exact numerics mode's trainer scorer makes and reduces its logits a chunk of tokens at a time (the LM head's
invariant matmul and the row-wise log-softmax statistics), never the [tokens, vocabulary] logits at once: a token's
log p(target) and entropy are the same bits in chunks of any size, ragged last chunk included, as from the whole
micro-batch's logits in one piece (what the engine's sampler reduces a decode step's rows with)."""
import dataclasses

import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.tools.bench.rollout import TINY
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.logprobs import chunked_softmax_stats, softmax_stats
from moe_rl_eks.workloads.model.paged_forward import sequence_hidden
from moe_rl_eks.workloads.rl.protocol import TrainingSample, VersionRef, one_version
from moe_rl_eks.workloads.trainer.microbatch import Sequences
from moe_rl_eks.workloads.trainer.numerics import ExactScorer

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest
# one layer; a vocabulary that is no multiple of the invariant matmul's column tiles (a partial last tile)
CONFIG = dataclasses.replace(TINY, num_hidden_layers=1, vocab_size=300)


def test_the_exact_scorers_logprobs_and_entropies_are_the_same_bits_in_any_chunking():
    torch.manual_seed(0)
    policy = MoETransformer(CONFIG).to(DEVICE)
    with torch.no_grad():  # logits with a spread (a random init's are nearly uniform)
        policy.lm_head.weight.mul_(8)
    lengths = [(7, 6), (3, 9), (5, 2)]  # prompt, completion: 29 tokens through the model
    ids = torch.randint(0, CONFIG.vocab_size, (sum(p + c for p, c in lengths),)).tolist()
    samples, at = [], 0
    for i, (p, c) in enumerate(lengths):
        samples.append(TrainingSample(f"s{i}", ids[at:at + p], ids[at + p:at + p + c], [0.0] * c, 0.0, 1.0, True,
                                      one_version(VersionRef(0, 0), c)))
        at += p + c
    mb = Sequences.of(samples).to(torch.device(DEVICE))
    tokens = mb.packed_inputs()[0].shape[0]
    scorer = ExactScorer(policy, torch.device(DEVICE))
    scorer.load(policy.state_dict())
    assert scorer.chunk_tokens >= tokens  # the default takes this micro-batch in one chunk

    # the reference: the whole micro-batch's logits in one piece, reduced at once
    hidden, _, _ = sequence_hidden(scorer.model, scorer.packed, scorer.kernels, mb.packed_inputs()[0], mb.lengths)
    logits = scorer.kernels.linear(hidden, scorer.model.lm_head.weight)
    assert logits.shape == (tokens, CONFIG.vocab_size)
    logp, entropy, _ = softmax_stats(logits, mb.packed_targets(), 0.7)
    whole = (mb.unpack(logp), mb.unpack(entropy))
    assert whole[0][mb.valid].lt(0).all() and whole[1][mb.valid].gt(0).all()  # real numbers, not zeros

    head = scorer.model.lm_head.weight
    for chunk in (1, 4, 11, tokens - 1):
        stats = chunked_softmax_stats(hidden, lambda rows: scorer.kernels.linear(rows, head), mb.packed_targets(),
                                      0.7, chunk)
        assert torch.equal(stats[:2], torch.stack([logp, entropy])), f"chunks of {chunk} tokens differ"
    scorer.chunk_tokens = 4  # the scorer itself, from the tokens, in a ragged chunking
    for name, got, want in zip(("log p", "entropy"), scorer.logprobs(mb, 0.7), whole):
        assert torch.equal(got, want), f"the scorer's {name} in chunks of 4 tokens differs from the whole batch's"
