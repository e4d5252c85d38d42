"""A rollout server spanning two "GPUs": two torchrun ranks over gloo, each holding half of the experts and
batching its own rows continuously. It must answer exactly as a one-process server with the same weights."""
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_helpers import call, publish_initial, write_run

from safetensors.torch import save_file

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import hf_config, to_hf_tensors
from moe_rl_eks.tools.local_run import LocalCluster, descendants, output_dir
from moe_rl_eks.workloads.rollout.engine import RolloutEngine
from moe_rl_eks.workloads.rollout.server import RolloutServer, make_app
from moe_rl_eks.workloads.rl.runtime import BackgroundServer, wait_for
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
from moe_rl_eks.workloads.rl.weights import DirectoryStore

# the module's sharded server (two gloo ranks) starts once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("sharded_rollout")

REQUESTS = [  # uneven rows: 1, 3, 4, 2 and 1 -> the ranks' shares differ, and a lone row leaves a rank idle
    {"prompt": "3+4=", "n": 1, "max_tokens": 3, "temperature": 0.0},
    {"prompt": "1+2=", "n": 3, "max_tokens": 3, "temperature": 1.0, "seed": 11, "return_routing": True},
    {"prompt": "4+4=", "n": 4, "max_tokens": 2, "temperature": 1.0, "top_p": 0.8, "seed": 5},
    {"prompt": "2+0=", "n": 2, "max_tokens": 3, "temperature": 0.7, "seed": 3, "return_routing": True},
    {"prompt": "0+1=", "n": 1, "max_tokens": 1, "temperature": 1.0, "seed": 9},
]


def completions(url, requests, together: bool):
    """Each request's choices; sent one after another, or all at once so they share batches."""
    answers = [None] * len(requests)

    def send(i):
        status, body = call("POST", f"{url}/v1/completions", {**requests[i], "logprobs": 1})
        assert status == 200, body
        answers[i] = body

    if together:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    else:
        for i in range(len(requests)):
            send(i)
    return answers


def same_routing(x, y) -> bool:
    """Both without routing, or routing of the same bytes (the store's keys differ: each server names its own)."""
    a, b = x.get("routing_ref"), y.get("routing_ref")
    if a is None or b is None:
        return a is b
    return {**a, "key": ""} == {**b, "key": ""} and a["key"] != b["key"]


def assert_same(sharded, single):
    for a, b in zip(sharded, single):
        assert a["weight_version"] == b["weight_version"]
        for x, y in zip(a["choices"], b["choices"], strict=True):
            assert x["token_ids"] == y["token_ids"] and same_routing(x, y)
            assert x["logprobs"]["token_logprobs"] == pytest.approx(y["logprobs"]["token_logprobs"], abs=1e-5)


def start_sharded(tmp_path):
    """The run served by two ranks (torchrun, gloo) with version 0 published: (cluster, its server, run, store)."""
    path = write_run(tmp_path, rollout={"gpus_per_server": 2, "max_batch_size": 16},
                     sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
    run = load_run(path)
    store = DirectoryStore(output_dir(run) / "weights")
    publish_initial(run, store, version=0, seed=1)
    cluster = LocalCluster(str(path), run)
    sharded = cluster.start_server(0)
    return cluster, sharded, run, store


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The same run served by two ranks and by one in-process engine, for the module: starting the two ranks is
    most of a test's time, and every test leaves both serving the same version."""
    tmp_path = tmp_path_factory.mktemp("servers")
    cluster, sharded, run, store = start_sharded(tmp_path)
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())  # one process, the whole model
    engine.load_version(0)
    http = BackgroundServer(make_app(RolloutServer(run, engine, CharTokenizer(), token=None))).start()
    try:
        wait_for(f"{sharded.url}/ready", timeout=120)  # /health answers before the weights are loaded
        yield {"sharded": sharded.url, "single": http.url, "store": store,
               "run": run, "engine": engine, "token": cluster.env[run.rl.weight_token_env], "logs": cluster.logs}
    finally:
        cluster.stop()
        http.stop()
        engine.stop()


def test_a_server_sharded_over_two_ranks_answers_as_one_process_does_and_swaps_versions_on_both(servers):
    sharded, single = servers["sharded"], servers["single"]
    log = (servers["logs"] / "rollout-0.log").read_text()
    assert "expert parallelism: backend=alltoall ranks=2 rank=1" in log  # each rank holds 2 of the 4 experts
    # decode too: DeepEP's low-latency kernels refuse this model (a CPU; on a GPU its hidden size), saying why
    assert "ep decode backend alltoall: DeepEP low-latency refused: " in log
    assert_same(completions(sharded, REQUESTS, together=False), completions(single, REQUESTS, together=False))
    assert_same(completions(sharded, REQUESTS, together=True), completions(single, REQUESTS, together=False))

    publish_initial(servers["run"], servers["store"], version=1, seed=2)
    auth = {"Authorization": f"Bearer {servers['token']}"}
    status, body = call("POST", f"{sharded}/v1/weights/load", {"version": 1}, headers=auth)
    assert status == 200 and body["weight_version"] == 1, body
    servers["engine"].load_version(1)
    after = completions(sharded, REQUESTS, together=True)
    assert_same(after, completions(single, REQUESTS, together=False))
    assert after[0]["weight_version"] == 1

    # a version whose file lacks experts 2-3: rank 0 reads its slice (experts 0-1), rank 1 cannot read its own.
    # Both refuse it together, and both keep serving version 1.
    publish_lacking_experts(servers["run"], servers["store"], version=7, lacking=range(2, 4))
    status, body = call("POST", f"{sharded}/v1/weights/load", {"version": 7}, headers=auth)
    message = body["error"]["message"]
    assert status == 409 and "rank 1: checkpoint lacks" in message and "rank 0" not in message, body
    assert call("GET", f"{sharded}/health")[1]["weight_version"] == 1
    assert_same(completions(sharded, REQUESTS[:2], together=True), after[:2])

    # The engine counts every rank's tokens of a step as one step: each token is a row's first or follows the
    # row's previous one by a step (0 only when both came in one step: a prefill's token, then a decode's).
    text = call("GET", f"{sharded}/metrics")[1]
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    rows = samples["moerl_rollout_time_to_first_token_seconds_count"]
    later = samples["moerl_rollout_inter_token_latency_seconds_count"]
    assert rows > 0 and rows + later == samples["moerl_rollout_generation_tokens_total"]
    assert samples['moerl_rollout_inter_token_latency_seconds_bucket{le="0.001"}'] <= rows


def publish_lacking_experts(run, store, version, lacking):
    staging = store.root.parent / f"src-{version}"
    staging.mkdir()
    tensors = to_hf_tensors(MoETransformer(run.model).state_dict(), run.model)
    save_file({k: v for k, v in tensors.items() if not any(f".experts.{j}." in k for j in lacking)},
              staging / "model.safetensors")
    (staging / "config.json").write_text(json.dumps(hf_config(run.model)))
    store.publish(version, staging)


def test_a_lost_rank_ends_the_whole_sharded_server_instead_of_leaving_it_hung(tmp_path):
    cluster, role, _, _ = start_sharded(tmp_path)  # its own: this test ends it
    try:
        wait_for(f"{role.url}/ready", timeout=120)
        ranks = {int(environ(pid).get("RANK", -1)): pid for pid in descendants(role.proc.pid)}
        os.kill(ranks[1], signal.SIGKILL)  # rank 0 would wait in its next collective forever
        # torchrun stops rank 0 too: the pod restarts, the orchestrator fails over
        assert role.proc.wait(timeout=60) != 0
        with pytest.raises(OSError):
            call("GET", f"{role.url}/health", timeout=2)
    finally:
        cluster.stop()


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_a_sharded_server_streams_the_tokens_one_process_answers(servers):
    import httpx

    request = {"prompt": "1+2=", "n": 3, "max_tokens": 3, "temperature": 1.0, "seed": 11, "logprobs": 1}
    with httpx.stream("POST", f"{servers['sharded']}/v1/completions", json={**request, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"] for line in lines[:-1]]
    status, whole = call("POST", f"{servers['single']}/v1/completions", request)
    assert status == 200
    for i, choice in enumerate(whole["choices"]):
        mine = [c[0] for c in chunks if c and c[0]["index"] == i]
        assert len(mine) >= len(choice["token_ids"]) > 0  # an event per sampled token
        assert "".join(c["text"] for c in mine) == choice["text"]


SWAP_PROMPTS = [(1, 6, 13, 7, 16), (1, 4, 13, 5, 16)]  # two prompts: the engine puts one on each rank


def inflight_rank(rank: int, port: int, run_path: str, root: str, out: dict) -> None:
    """Rank 0 runs the engine over a two-rank replica: two rows decode (one per rank) while version 1 is loaded;
    rank 1 follows."""
    from moe_rl_eks.workloads.moe.parallel import ExpertParallel
    from moe_rl_eks.workloads.rollout.engine import RowRequest, SamplingParams
    from moe_rl_eks.workloads.rollout.replica import Replica, follow

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run = load_run(run_path)
        replica = Replica(run, ep=ExpertParallel(dist.group.WORLD, "alltoall"), control=dist.new_group(backend="gloo"),
                          device=torch.device("cpu"))
        if rank > 0:
            follow(replica)
            return
        engine = RolloutEngine(run, DirectoryStore(root), Path(root).parent / "cache", CharTokenizer(), replica)
        engine.load_version(0)
        loader = threading.Thread(target=engine.load_version, args=(1,))

        def slow_rows(events):  # the first tokens start the load; the rows run on slowly while it swaps in
            if not loader.is_alive() and engine.version == 0:
                loader.start()
            time.sleep(0.05)

        requests = [RowRequest(p, SamplingParams(30, seed=0), "swap", i) for i, p in enumerate(SWAP_PROMPTS)]
        outputs = engine.submit(requests, slow_rows).result(timeout=120)
        loader.join(timeout=60)
        out["rows"] = [(o.token_ids, o.logprobs, [(s.lineage, s.version, s.tokens) for s in o.weight_versions])
                       for o in outputs]
        out["swaps"] = engine.metrics.registry.get_sample_value("moerl_rollout_rows_at_swap_total")
        engine.stop()
    finally:
        dist.destroy_process_group()


def test_a_sharded_replica_swaps_in_flight_on_both_ranks_and_each_row_goes_on_from_its_kv(tmp_path):
    from moe_rl_eks.workloads.model.checkpoint import load_hf
    from moe_rl_eks.workloads.rollout.decoder import Decoder
    from moe_rl_eks.workloads.rollout.engine import RowRequest, SamplingParams
    from moe_rl_eks.workloads.rollout.replica import empty_model
    from moe_rl_eks.workloads.rollout.weight_staging import install

    path = write_run(tmp_path, rollout={"gpus_per_server": 2, "max_batch_size": 4, "max_new_tokens": 40},
                     sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
    run = load_run(path)
    assert run.weight_swap == "inflight"
    store = DirectoryStore(tmp_path / "weights")
    publish_initial(run, store, version=0, seed=1)
    publish_initial(run, store, version=1, seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(inflight_rank, args=(port, str(path), str(store.root), out), nprocs=2, start_method="spawn")
    assert out["swaps"] == 2  # both rows were running (one on each rank) when version 1 came in
    states = [load_hf(store.fetch(v, tmp_path / "reference"))[1] for v in (0, 1)]
    for prompt, (tokens, logprobs, spans) in zip(SWAP_PROMPTS, out["rows"]):
        assert [span[:2] for span in spans] == [(0, 0), (0, 1)] and sum(span[2] for span in spans) == len(tokens)
        # One process, the whole model, swapped by hand after the same token: the same continuation
        model = empty_model(run.model, None, run.moe_compute, torch.device("cpu"))
        install(model, states[0])
        max_len = min(run.model.max_position_embeddings, run.rl.sampling.max_prompt_tokens + 40)
        decoder = Decoder(model.eval(), slots=2, max_len=max_len, eos_ids=CharTokenizer().eos_ids, cuda_graphs=False)
        seq = decoder.add(RowRequest(prompt, SamplingParams(30, seed=0), "swap", SWAP_PROMPTS.index(prompt)))
        while len(seq.tokens) < spans[0][2]:
            decoder.step()
        install(model, states[1])
        decoder.load_weights()
        while decoder.busy:
            decoder.step()
        assert seq.tokens == tokens and seq.logprobs == pytest.approx(logprobs, abs=1e-5)
