"""`moerl serve-rollout --model DIR` at the engine's speed by default: triton compute on a GPU where the model's rows
fit its kernels, vLLM's batch and memory flags (--max-num-seqs, --gpu-memory-utilization) validated with errors
naming the flag, the value and what is allowed, and the KV cache's arithmetic: what the share leaves after the
served weights and the CUDA overhead, refused with the numbers when one full row does not fit."""
import argparse
import dataclasses

import pytest

from moe_rl_eks.core import memory
from moe_rl_eks.tools.bench.weights import QWEN3_30B_A3B
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import save_hf
from moe_rl_eks.workloads.rl.model_dir import kv_cache_positions, serving_compute
from moe_rl_eks.workloads.rollout.serve import main, model_served

H200_BYTES = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory on an H200
TINY = dataclasses.replace(QWEN3_30B_A3B, vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=256, dtype="float32")


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(MoETransformer(TINY), TINY, tmp_path / "tiny")
    return tmp_path / "tiny"


def test_a_served_checkpoint_runs_triton_on_a_gpu_where_its_rows_fit_its_kernels_and_torch_elsewhere():
    assert serving_compute(QWEN3_30B_A3B, cuda=True)[0] == "triton"
    assert serving_compute(QWEN3_30B_A3B, cuda=False) == ("torch", "no CUDA GPU (the triton kernels need one)")
    compute, why = serving_compute(dataclasses.replace(QWEN3_30B_A3B, hidden_size=2044), cuda=True)
    assert compute == "torch" and "model.hidden_size (2044) is not a multiple of 8" in why


def test_the_kv_cache_gets_what_the_share_leaves_after_the_served_weights_and_the_cuda_overhead():
    m = QWEN3_30B_A3B
    positions = kv_cache_positions(m, gpu_bytes=H200_BYTES, utilization=0.9, max_len=40960)
    weights = m.parameter_count() * 2  # bf16
    per_position = 2 * 48 * 4 * 128 * 2  # keys and values of 48 layers, 4 KV heads of 128, bf16
    assert positions == int(0.9 * H200_BYTES - weights - memory.CUDA_OVERHEAD_BYTES) // per_position
    assert 700_000 < positions < 760_000  # ~72 GB of KV cache: 18 rows of the whole 40,960-token context
    # Two GPUs split the experts: each holds about half the weights, so more positions fit each
    assert kv_cache_positions(m, gpu_bytes=H200_BYTES, utilization=0.9, max_len=40960, gpus=2) > 1.3 * positions


def test_a_share_that_cannot_hold_the_weights_and_one_full_row_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as err:
        kv_cache_positions(QWEN3_30B_A3B, gpu_bytes=H200_BYTES, utilization=0.4, max_len=40960)
    text = str(err.value)
    assert text.startswith("--gpu-memory-utilization: 0.4 of the GPU's 140.4 GiB is 56.2 GiB; the weights and CUDA "
                           "overhead take 58.9 GiB"), text
    assert "one 40960-position row's KV cache 3.75 GiB more" in text


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: 0.0: must be in (0, 1], the fraction of "
                                        "each GPU's memory"),
    (["--gpu-memory-utilization", "1.2"], "argument --gpu-memory-utilization: 1.2: must be in (0, 1]"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0: must be >= 1 (rows decoded at once)"),
    (["--max-model-len", "1"], "argument --max-model-len: 1: must be >= 2 (positions per row"),
    (["--compute", "cuda"], "argument --compute: invalid choice: 'cuda' (choose from"),
    (["--numerics", "bitwise"], "argument --numerics: invalid choice: 'bitwise' (choose from"),
])
def test_bad_flags_are_refused_naming_the_flag_the_value_and_what_is_allowed(checkpoint, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(checkpoint), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_model_flags_are_refused_with_a_run_which_sets_its_own(capsys):
    with pytest.raises(SystemExit):
        main(["--run", "configs/runs/local.yaml", "--max-num-seqs", "8"])
    assert "--max-num-seqs applies to --model; a run sets rollout.max_batch_size" in capsys.readouterr().err


def test_max_model_len_narrows_the_served_rows_and_a_length_that_does_not_fit_is_refused(checkpoint, capsys):
    args = argparse.Namespace(model=str(checkpoint), max_new_tokens=None, max_model_len=64, max_num_seqs=None,
                              gpu_memory_utilization=None, compute=None, numerics=None)
    run = model_served(args, 1, cuda=False)  # the model's context is 256 positions
    assert (run.rl.sampling.max_prompt_tokens, run.rollout.max_new_tokens) == (48, 16)  # a row of 64: 16 new
    assert model_served(argparse.Namespace(**{**vars(args), "max_new_tokens": 60}), 1, cuda=False).rl.sampling \
        .max_prompt_tokens == 4
    for flags, message in ((["--max-model-len", "257"], "max_model_len: 257 positions; allowed 2..256 (the model's "
                                                        "max_position_embeddings in "),
                           (["--max-model-len", "64", "--max-new-tokens", "64"],
                            "max_new_tokens: 64; allowed 1..63, leaving a row of 64 positions room for a prompt")):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", str(checkpoint), *flags])
        assert message in str(exit_.value) and f"--model {checkpoint}" in str(exit_.value)
    with pytest.raises(SystemExit):
        main(["--run", "configs/runs/local.yaml", "--max-model-len", "64"])
    assert "--max-model-len applies to --model" in capsys.readouterr().err


def test_on_the_cpu_a_served_checkpoint_runs_torch_with_the_smaller_batch_unless_told(checkpoint):
    args = argparse.Namespace(model=str(checkpoint), max_new_tokens=8, max_model_len=None, max_num_seqs=None,
                              gpu_memory_utilization=None, compute=None, numerics=None)
    run = model_served(args, 1, cuda=False)
    assert (run.moe_compute, run.rollout.max_batch_size, run.serving_compute) == ("torch", 64, "torch")
    told = model_served(argparse.Namespace(**{**vars(args), "max_num_seqs": 8, "compute": "triton",
                                              "numerics": "exact"}), 1, cuda=False)
    assert (told.moe_compute, told.rollout.max_batch_size) == ("triton", 8)
    assert (told.numerics, told.serving_compute) == ("exact", "exact")  # the engine's kernels: the exact backend


def test_bench_load_times_dd_and_the_replicas_read_of_the_same_files(checkpoint, tmp_path):
    import json

    from moe_rl_eks.tools.bench.load import main as bench_load

    assert bench_load(["--model", str(checkpoint), "--json", str(tmp_path / "load.json")]) == 0
    results = json.loads((tmp_path / "load.json").read_text())
    assert results["files"] == len(list(checkpoint.glob("*.safetensors")))
    assert results["bytes"] == pytest.approx(sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")), abs=1)
    assert results["seconds"]["dd_direct"] > 0 and results["seconds"]["staging_read"] > 0


def test_bench_loads_random_checkpoint_holds_bitwise_the_weights_bench_server_serves(tmp_path):
    # h200-serve-model.sh sets the served checkpoint beside bench-server's own engine: the same weights (so the
    # same routing, whose spread over the experts sets an MoE decode step's cost) leave only the serving path
    import torch

    from moe_rl_eks.tools.bench.load import random_checkpoint
    from moe_rl_eks.tools.bench.rollout import build_model
    from moe_rl_eks.workloads.model.checkpoint import load_hf

    config = dataclasses.replace(TINY, dtype="bfloat16")
    _, served = load_hf(random_checkpoint(tmp_path / "random", config))
    torch.manual_seed(0)
    engine = build_model(config, torch.device("cpu")).state_dict()
    assert served.keys() == engine.keys()
    for name, tensor in engine.items():
        assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), name
    assert engine["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # drawn, not left at zero
