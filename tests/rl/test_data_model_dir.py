"""A Hugging Face checkpoint directory without a run: the run derived from its files, and a rollout engine that
serves the directory in place (what `moerl serve-rollout --model DIR` builds)."""
import pytest
import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import CheckpointError, save_hf
from moe_rl_eks.workloads.rl.model_dir import MODEL_VERSION, ModelDirectoryStore, model_run
from moe_rl_eks.workloads.rl.tokenizer import load_tokenizer, write_tokenizer_files
from moe_rl_eks.workloads.rl.weights import IncompleteVersion


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=18, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, dtype="float32")
    save_hf(MoETransformer(config), config, tmp_path / "ckpt")
    write_tokenizer_files("builtin", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_run_is_derived_from_the_checkpoint_files(checkpoint):
    run = model_run(checkpoint, max_new_tokens=8)
    assert run.name == "ckpt" and run.model.vocab_size == 18 and run.model.max_position_embeddings == 64
    assert run.rl.sampling.tokenizer == str(checkpoint) and run.rollout.max_new_tokens == run.rl.sampling.max_tokens == 8
    assert run.rl.sampling.max_prompt_tokens == 56 and model_run(checkpoint).rollout.max_new_tokens == 16
    with pytest.raises(CheckpointError, match="no config.json"):
        model_run(checkpoint / "nothing")


def test_a_long_context_checkpoint_gives_a_valid_run(checkpoint, tmp_path):
    """Qwen3-30B-A3B's context (40,960) is longer than the default micro-batch token budget."""
    import json
    import shutil

    long = tmp_path / "long"
    shutil.copytree(checkpoint, long)
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40960}))
    run = model_run(long)
    assert run.rollout.max_new_tokens == 8192 and run.rl.sampling.max_prompt_tokens == 40960 - 8192
    assert run.rl.training.max_tokens_per_microbatch >= 40960 - 1


def test_engine_serves_the_directory_in_place_and_stops_on_its_eos_ids(checkpoint, tmp_path):
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine, RowRequest, SamplingParams

    run = model_run(checkpoint, max_new_tokens=6)
    store = ModelDirectoryStore(checkpoint)
    tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
    engine = RolloutEngine(run, store, tmp_path / "cache", tokenizer)
    try:
        engine.load_version(store.latest().version)
        rows = [RowRequest(tuple(tokenizer.encode("1+2=")) or (1,), SamplingParams(6, seed=s), f"r{s}", 0)
                for s in range(8)]
        outputs = engine.submit(rows).result(timeout=120)
    finally:
        engine.stop()
    assert engine.version == MODEL_VERSION and len(outputs) == 8
    for out in outputs:
        assert out.finish_reason in ("stop", "length") and 1 <= len(out.token_ids) <= 6
        assert (out.finish_reason == "stop") == (out.token_ids[-1] in tokenizer.eos_ids)
    assert (checkpoint / "model.safetensors").is_file()  # read in place, never removed
    with pytest.raises(IncompleteVersion, match="only version 0"):
        store.fetch(1, tmp_path)
    with pytest.raises(RuntimeError, match="served as it is"):
        store.publish(1, checkpoint)


def test_serve_rollout_model_serves_a_checkpoint_directory_over_openai_http(tmp_path):
    """`moerl serve-rollout --model DIR`: a checkpoint (weights, config.json, tokenizer with a chat template,
    generation_config.json) answers completions and chat completions without a run."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from rl_helpers import REPO

    from moe_rl_eks.tools.example_data import write_tokenizer_dir

    directory = tmp_path / "tiny-chat"
    write_tokenizer_dir(directory, ["Ann has 3 apples. How many apples?"] * 20, vocab_size=280)
    tokenizer = load_tokenizer(str(directory))
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256, dtype="float32")
    save_hf(MoETransformer(config), config, directory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moe_rl_eks.tools.cli", "serve-rollout", "--model", str(directory),
                             "--host", "127.0.0.1", "--port", str(port), "--max-new-tokens", "8"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def post(path, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                    if json.load(resp)["weight_version"] == 0:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        chat = post("/v1/chat/completions", {"model": "tiny-chat", "n": 2, "max_tokens": 4, "seed": 1,
                                             "messages": [{"role": "user", "content": "Ann has 3 apples."}]})
        assert len(chat["choices"]) == 2 and chat["usage"]["prompt_tokens"] == len(tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": "Ann has 3 apples."}])))
        plain = post("/v1/completions", {"model": "tiny-chat", "prompt": "Ann has", "max_tokens": 3})
        assert plain["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
