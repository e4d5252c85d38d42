"""Bad runs, environments and stack outputs fail `moerl manifests` with a message naming the field, the value and
what is allowed, and nothing is written (earlier manifests of the run stay as they were)."""
from __future__ import annotations

import json

import pytest
import yaml
from manifest_helpers import EXAMPLE_OUTPUTS, ROOT, run_file

from moe_rl_eks.core.environment import load_environments
from moe_rl_eks.core.run import RunConfig, load_run, resolve_run
from moe_rl_eks.core.schema import ConfigError, parse
from moe_rl_eks.k8s.manifests import main

QWEN = yaml.safe_load(run_file("qwen3-30b-a3b-p5").read_text())


def patched(data: dict, path: str, value) -> dict:
    data = json.loads(json.dumps(data))
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return data


def manifests(tmp_path, run: dict, *extra: str, outputs=EXAMPLE_OUTPUTS) -> tuple[int, str, object]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    args = ["--run", str(path), "--out", str(tmp_path / "dist"), "--cdk-json", str(ROOT / "cdk.json"), *extra]
    if outputs is not None:
        args += ["--outputs", str(outputs)]
    return main(args), path


@pytest.mark.parametrize("patches, field, fragment", [
    # the EP degree (2 nodes x 8 GPUs) must divide the experts
    ({"model.num_experts": 120}, "parallelism.ep_backend",
     "num_experts (120) must be divisible by the expert-parallel size (16)"),
    # more GPUs than the pools have
    ({"parallelism.trainer_nodes": 3}, "parallelism.trainer_nodes", "trainer pool has at most 2 nodes"),
    ({"rollout.max_servers": 5}, "rollout.max_servers", "rollout pool fits at most 4 servers of 2 GPU(s)"),
    ({"rollout.gpus_per_server": 1}, "rollout.gpus_per_server", "GiB of weights need more than 80 % of 1 x 45 GiB"),
    # DeepEP's intranode kernels take 2, 4 or 8 ranks
    ({"parallelism.trainer_nodes": 1, "parallelism.ranks_per_node": 6, "parallelism.ep_backend": "deepep",
      "model.num_experts": 96}, "parallelism.ep_backend", "intranode needs (2, 4, 8) ranks, not 6"),
    ({"deploy.images.trainer": "latest"}, "deploy.images.trainer", "floating tags"),
    ({"deploy.images.rollout": "sha256:abc"}, "deploy.images.rollout", "expected a digest (sha256:<64 hex>)"),
    ({"deploy": None}, "deploy", "needs deploy.images"),
    ({"rl.training.output_dir": "runs/q"}, "rl.training.output_dir", "must be on the FSx volume (under /fsx/)"),
    ({"rl.weights": {"kind": "local"}}, "rl.weights", "use kind: fs with a path under /fsx/ or kind: s3"),
    # routing replay: the servers' routed experts must land where every trainer rank reads them
    ({"rl.routing": {"path": "/tmp/routing"}}, "rl.routing.path", "a path under /fsx/ (default: <output_dir>/routing)"),
    ({"deploy.rollout_shm_gib": 100}, "deploy.rollout_shm_gib", "at most half of the pod's memory"),
    ({"name": "a-run-name-that-is-far-too-long-for-k8s"}, "name", "at most 30 characters"),
    ({"environment": None}, "environment", "declares no environment (a local run)"),
    ({"environment": "staging"}, "env", "known environments: dev, prod"),
    # S3 outside what the run's roles may use passes every other check and fails at run time with AccessDenied
    ({"rl.weights": {"kind": "s3", "bucket": "someone-elses-bucket"}}, "rl.weights.bucket",
     "the trainer and rollout roles may use only the stack's bucket 'moe-rl-dev-artifacts-111111111111'"),
    ({"rl.weights": {"kind": "s3", "bucket": "moe-rl-dev-artifacts-111111111111", "prefix": "models"}},
     "rl.weights.prefix", "only 'weights/'"),
    ({"rl.data.train": "s3://example-rl-datasets/math/train.parquet"}, "rl.data.train",
     "the orchestrator's role may read only s3://moe-rl-dev-artifacts-111111111111/prompts/"),
    ({"rl.data.eval": "s3://moe-rl-dev-artifacts-111111111111/runs/x/test.parquet"}, "rl.data.eval",
     "/fsx/prompts/... reads the same files"),
    ({"rl.data.train": ["s3://moe-rl-dev-artifacts-111111111111/prompts/math/", "s3://other/math/*.parquet"]},
     "rl.data.train[1]", "the orchestrator's role may read only s3://moe-rl-dev-artifacts-111111111111/prompts/"),
    ({"deploy.images.orchestrator": "latest"}, "deploy.images.orchestrator", "floating tags"),
    ({"parallelism.trainer_nodes": 2, "parallelism.ep_backend": "deepep"}, "parallelism.ep_backend",
     "deploy.images.deepep_efa: true"),
])
def test_bad_run_fails_clearly_and_writes_nothing(tmp_path, capsys, patches, field, fragment):
    run = QWEN
    for path, value in patches.items():
        run = patched(run, path, value)
    rc, _ = manifests(tmp_path, run)
    err = capsys.readouterr().err
    assert rc == 2
    assert f": {field}: " in err and fragment in err, err
    assert err.rstrip().endswith("nothing written")
    assert not any((tmp_path / "dist").rglob("*.yaml"))


@pytest.mark.parametrize("edit, fragment", [
    (lambda o: o["MoeRlEks-dev"].pop("PrometheusEndpoint"), "PrometheusEndpoint: None is not allowed; the rollout "
     "autoscaler reads the queue depth from Amazon Managed Prometheus"),
    (lambda o: o.pop("MoeRlEks-dev"), "expected exactly one stack with repositories in account 111111111111, region "
     "us-east-1"),
    (lambda o: o["MoeRlEks-dev"].update(RolloutRepositoryUri="222222222222.dkr.ecr.us-east-2.amazonaws.com/x"),
     "RolloutRepositoryUri: '222222222222.dkr.ecr.us-east-2.amazonaws.com/x' is not allowed"),
    (lambda o: o["MoeRlEks-dev"].update(PrometheusEndpoint="http://prometheus:9090"),
     "expected https://aps-workspaces.us-east-1.amazonaws.com/workspaces/ws-..."),
    (lambda o: o["MoeRlEks-dev"].pop("OrchestratorRepositoryUri"), "OrchestratorRepositoryUri: None is not allowed"),
    (lambda o: o["MoeRlEks-dev"].update(ScraperSubnetCidrs="192.168.0.0/28"),
     "expected the comma-separated CIDRs of the scraper's subnets inside the VPC 10.20.0.0/16"),
    (lambda o: o["MoeRlEks-dev"].pop("ArtifactBucketName"), "ArtifactBucketName: None is not allowed"),
])
def test_bad_stack_outputs_fail_clearly(tmp_path, capsys, edit, fragment):
    outputs = json.loads(EXAMPLE_OUTPUTS.read_text())
    edit(outputs)
    (tmp_path / "outputs.json").write_text(json.dumps(outputs))
    rc, _ = manifests(tmp_path, QWEN, outputs=tmp_path / "outputs.json")
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err, err
    assert not (tmp_path / "dist").exists()


def test_missing_outputs_file_says_where_it_comes_from(tmp_path, capsys):
    rc, _ = manifests(tmp_path, QWEN, outputs=None)
    assert rc == 2 and "pass its --outputs-file" in capsys.readouterr().err


def test_env_flag_must_match_the_runs_environment(tmp_path, capsys):
    rc, _ = manifests(tmp_path, QWEN, "--env", "prod")
    assert rc == 2 and "--env is 'prod'; a run is checked against the environment it declares" in capsys.readouterr().err


def test_failure_during_synthesis_keeps_the_previous_manifests(tmp_path, capsys):
    assert manifests(tmp_path, QWEN)[0] == 0
    target = tmp_path / "dist" / "dev" / QWEN["name"]
    before = {p.name: p.read_text() for p in target.iterdir()}
    # The shm check runs while the chart is built, after the run resolved: the staging copy must vanish.
    rc, _ = manifests(tmp_path, patched(QWEN, "deploy.rollout_shm_gib", 100))
    assert rc == 2 and "deploy.rollout_shm_gib" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in target.iterdir()} == before
    assert [p.name for p in target.parent.iterdir()] == [QWEN["name"]]  # no staging directory left behind


def _env_with_trainer(instance: str):
    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    context["environments"]["dev"]["trainer_pool"]["instance_type"] = instance
    return load_environments(context)["dev"]


def test_deepep_is_refused_on_gpus_without_nvlink_and_auto_falls_back():
    env = _env_with_trainer("g6e.48xlarge")  # 8 L40S on PCIe
    run = load_run(run_file("dev-small"))
    assert resolve_run(run, env).ep_backend == "alltoall"  # `auto` would pick DeepEP for one node of 8
    forced = patched(yaml.safe_load(run_file("dev-small").read_text()), "parallelism.ep_backend", "deepep")
    with pytest.raises(ConfigError, match="share NVLink in groups of 1, not 8"):
        resolve_run(parse(RunConfig, forced, source="run.yaml"), env)


def test_longest_allowed_run_name_keeps_every_pod_host_name_a_dns_label(tmp_path):
    name = "r" * 30
    assert manifests(tmp_path, patched(QWEN, "name", name))[0] == 0
    nodes = QWEN["parallelism"]["trainer_nodes"]
    for path in (tmp_path / "dist" / "dev" / name).glob("*.k8s.yaml"):
        for obj in yaml.safe_load_all(path.read_text()):
            if obj["kind"] == "JobSet":  # JobSet names pods <jobset>-<replicated job>-<job index>-<pod index>
                host = f"{obj['metadata']['name']}-{obj['spec']['replicatedJobs'][0]['name']}-0-{nodes - 1}"
                assert len(host) <= 63, host
