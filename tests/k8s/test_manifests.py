"""What the example runs' manifests must say: gang scheduling, autoscaling, resources, security, network policy."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml
from manifest_helpers import CLUSTER_RUNS, EXAMPLE_OUTPUTS, ROOT, find, pod_specs, run_file

from moe_rl_eks.core import cluster, labels, metrics
from moe_rl_eks.core.environment import load_cdk_json
from moe_rl_eks.core.run import load_run, resolve_run

ENVS = load_cdk_json(ROOT / "cdk.json")


def resolved(name: str):
    run = load_run(run_file(name))
    return resolve_run(run, ENVS[run.environment])


def containers(objects):
    """Every container, init containers (the startup check) included."""
    return [c for obj in objects for spec in pod_specs(obj) for c in spec["containers"] + spec.get("initContainers", [])]


def test_example_runs_resolve_to_the_backends_the_auto_rule_promises():
    assert (resolved("dev-small").ep_backend, resolved("dev-small").topology.ep_size) == ("deepep", 8)
    assert (resolved("qwen3-30b-a3b-p5").ep_backend, resolved("qwen3-30b-a3b-p5").topology.ep_size) == ("alltoall", 16)


def test_each_run_writes_a_run_and_a_validation_manifest(manifests):
    assert sorted(manifests) == ["dev-small/run.k8s.yaml", "dev-small/validation.k8s.yaml",
                                 "qwen3-30b-a3b-p5/run.k8s.yaml", "qwen3-30b-a3b-p5/validation.k8s.yaml"]


def test_everything_lands_in_the_environments_run_namespace(objects):
    assert {o["metadata"]["namespace"] for o in objects} == {ENVS["dev"].run_namespace}


@pytest.mark.parametrize("run", ["dev-small", "qwen3-30b-a3b-p5"])
def test_trainer_is_one_gang_admitted_through_kueue(manifests, run):
    r = resolved(run)
    jobset = find(manifests[f"{run}/run.k8s.yaml"], "JobSet", f"{run}-trainer")
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == cluster.TRAINER_QUEUE
    assert jobset["spec"]["suspend"] is True  # nothing starts before Kueue admits the whole JobSet
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1
    assert job["parallelism"] == job["completions"] == r.topology.nodes
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": r.run.deploy.trainer_max_restarts,
                                               "restartStrategy": "Recreate"}


def test_torchrun_rendezvous_goes_through_the_headless_service(manifests):
    docs = manifests["qwen3-30b-a3b-p5/run.k8s.yaml"]
    name = "qwen3-30b-a3b-p5-trainer"
    jobset, service = find(docs, "JobSet", name), find(docs, "Service", name)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert jobset["spec"]["network"]["subdomain"] == name
    (container,) = pod_specs(jobset)[0]["containers"]
    command = container["command"]
    assert command[:3] == ["torchrun", "--nnodes=2", "--nproc-per-node=8"]
    # pod 0 of job 0 of replicated job "node": JobSet's host name scheme, under the Service's subdomain
    assert f"--rdzv-endpoint={name}-node-0-0.{name}:{cluster.TRAINER_RENDEZVOUS_PORT}" in command
    assert "--rdzv-backend=c10d" in command and "--max-restarts=0" in command
    # torchrun's own parser must hand the whole command to every rank, flags included.
    from torch.distributed.run import get_args_parser
    args = get_args_parser().parse_args(command[1:])
    assert args.no_python and args.nnodes == "2"
    assert [args.training_script, *args.training_script_args] == ["moerl", "train", "--run", "/etc/moerl/run.yaml"]


@pytest.mark.parametrize("run, gpus, efa", [("dev-small", 8, 32), ("qwen3-30b-a3b-p5", 8, 32)])
def test_trainer_pod_takes_the_whole_p5_node(manifests, run, gpus, efa):
    spec = pod_specs(find(manifests[f"{run}/run.k8s.yaml"], "JobSet", f"{run}-trainer"))[0]
    (c,) = spec["containers"]
    limits = c["resources"]["limits"]
    assert (limits[labels.GPU_RESOURCE], limits[labels.EFA_RESOURCE]) == (gpus, efa)
    assert limits["hugepages-2Mi"] == "10240Mi" and c["resources"]["requests"]["memory"] == limits["memory"]
    # No IPC_LOCK: a non-root container would not get it; the node's memlock limit is what EFA needs.
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["fsx"]["persistentVolumeClaim"]["claimName"] == cluster.FSX_CLAIM_NAME
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", cluster.FSX_MOUNT_PATH}
    assert spec["serviceAccountName"] == cluster.TRAINER_SERVICE_ACCOUNT
    assert spec["priorityClassName"] == cluster.TRAINER_PRIORITY_CLASS
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": labels.ROLE_LABEL, "operator": "In", "values": ["trainer"]}]}]


@pytest.mark.parametrize("run, nvshmem", [("dev-small", "libfabric"), ("qwen3-30b-a3b-p5", None)])
def test_trainer_env_follows_the_resolved_backend(manifests, run, nvshmem):
    (c,) = pod_specs(find(manifests[f"{run}/run.k8s.yaml"], "JobSet", f"{run}-trainer"))[0]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["MOERL_EP_BACKEND"] == resolved(run).ep_backend
    assert env.get("NVSHMEM_REMOTE_TRANSPORT") == nvshmem
    if nvshmem:  # DeepEP over EFA: NVSHMEM's NIC policy and GDRCopy as AWS's DeepEP reference sets them
        assert env["NVSHMEM_NETDEVS_POLICY"] == "EXTERNAL_SHARING_PCIE_SWITCH_NIC_EXCLUSIVE"
        assert env["NVIDIA_GDRCOPY"] == "enabled"
    # torchrun must leave the workers' SIGTERM checkpoint time before it SIGKILLs them, inside the pod's grace
    spec = pod_specs(find(manifests[f"{run}/run.k8s.yaml"], "JobSet", f"{run}-trainer"))[0]
    assert 60 <= int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < spec["terminationGracePeriodSeconds"]
    # the trainer finds the orchestrator; its run file is resolved already (no cdk.json in the pod)
    assert env["MOERL_ORCHESTRATOR"] == f"http://{run}-orchestrator.moe-rl.svc.cluster.local:{cluster.ORCHESTRATOR_PORT}"
    assert "MOERL_CDK_JSON" not in env
    assert "MOERL_WEIGHT_TOKEN" not in env  # only the orchestrator and rollout servers hold the token


def test_autoscaled_rollout_has_no_replicas_and_a_queue_depth_scaler(manifests):
    docs = manifests["qwen3-30b-a3b-p5/run.k8s.yaml"]
    deployment = find(docs, "Deployment", "qwen3-30b-a3b-p5-rollout")
    assert "replicas" not in deployment["spec"]
    scaler = find(docs, "ScaledObject", "qwen3-30b-a3b-p5-rollout")["spec"]
    assert scaler["scaleTargetRef"]["name"] == "qwen3-30b-a3b-p5-rollout"
    assert (scaler["minReplicaCount"], scaler["maxReplicaCount"]) == (1, 4)
    (trigger,) = scaler["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "prometheus" and meta["query"].startswith(f"sum({metrics.ROLLOUT_QUEUE_DEPTH.name}{{")
    assert meta["threshold"] == str(resolved("qwen3-30b-a3b-p5").run.rl.orchestrator.max_inflight_requests)
    amp = yaml.safe_load(EXAMPLE_OUTPUTS.read_text())["MoeRlEks-dev"]["PrometheusEndpoint"]
    assert meta["serverAddress"] == amp.rstrip("/") and meta["awsRegion"] == "us-east-1"
    assert find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])["spec"] == {
        "podIdentity": {"provider": "aws"}}


@pytest.mark.parametrize("run, routing", [("dev-small", None), ("qwen3-30b-a3b-p5", "/fsx/runs/qwen3-30b-a3b-p5/routing")])
def test_rollout_servers_write_only_the_routing_store_of_the_fsx_volume_and_only_with_routing_replay(
        manifests, run, routing):
    spec = pod_specs(find(manifests[f"{run}/run.k8s.yaml"], "Deployment", f"{run}-rollout"))[0]
    (c,) = spec["containers"]
    fsx = {m["mountPath"]: m for m in c["volumeMounts"] if m["name"] == "fsx"}
    assert fsx[cluster.FSX_MOUNT_PATH]["readOnly"] is True
    claim = {v["name"]: v for v in spec["volumes"]}["fsx"]["persistentVolumeClaim"]
    if routing is None:
        assert list(fsx) == [cluster.FSX_MOUNT_PATH] and claim["readOnly"] is True
        return
    assert resolved(run).run.rl.algorithm.routing_replay
    assert fsx[routing]["readOnly"] is False and fsx[routing]["subPath"] == routing.removeprefix("/fsx/")
    assert claim["readOnly"] is False  # else no mount of it could write


def test_fixed_size_rollout_sets_replicas_and_has_no_scaler(manifests):
    docs = manifests["dev-small/run.k8s.yaml"]
    assert find(docs, "Deployment", "dev-small-rollout")["spec"]["replicas"] == 1
    assert not [d for d in docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]


@pytest.mark.parametrize("run, gpus", [("dev-small", 1), ("qwen3-30b-a3b-p5", 2)])
def test_a_rollout_server_of_several_gpus_runs_one_rank_per_gpu_under_torchrun(manifests, run, gpus):
    deployment = find(manifests[f"{run}/run.k8s.yaml"], "Deployment", f"{run}-rollout")
    (container,) = pod_specs(deployment)[0]["containers"]
    serve = ["moerl", "serve-rollout", "--run", "/etc/moerl/run.yaml", "--port", str(cluster.ROLLOUT_PORT)]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    if gpus == 1:
        assert container["command"] == serve
        return
    from torch.distributed.run import get_args_parser
    args = get_args_parser().parse_args(container["command"][1:])
    assert container["command"][0] == "torchrun" and args.standalone and args.nproc_per_node == str(gpus)
    assert args.no_python and [args.training_script, *args.training_script_args] == serve


def test_rollout_servers_probe_health_drain_and_yield_to_trainers(manifests):
    docs = manifests["qwen3-30b-a3b-p5/run.k8s.yaml"]
    spec = pod_specs(find(docs, "Deployment", "qwen3-30b-a3b-p5-rollout"))[0]
    (c,) = spec["containers"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"  # the engine loop is alive
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # listed to the orchestrator once weights are loaded
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 60}}
    assert spec["terminationGracePeriodSeconds"] > 60
    assert spec["priorityClassName"] == cluster.ROLLOUT_PRIORITY_CLASS
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert c["resources"]["limits"][labels.GPU_RESOURCE] == 2 and labels.EFA_RESOURCE not in c["resources"]["limits"]
    assert find(docs, "PodDisruptionBudget", "qwen3-30b-a3b-p5-rollout")["spec"]["maxUnavailable"] == 1
    assert find(docs, "Service", "qwen3-30b-a3b-p5-rollout")["spec"]["clusterIP"] == "None"


def test_orchestrator_is_pointed_at_the_rollout_service(manifests):
    docs = manifests["qwen3-30b-a3b-p5/run.k8s.yaml"]
    run = yaml.safe_load(find(docs, "ConfigMap", "qwen3-30b-a3b-p5-config")["data"]["run.yaml"])
    assert run["rl"]["orchestrator"]["endpoints"] == [
        f"dns+http://qwen3-30b-a3b-p5-rollout.moe-rl.svc.cluster.local:{cluster.ROLLOUT_PORT}"]
    orchestrator = find(docs, "Deployment", "qwen3-30b-a3b-p5-orchestrator")
    assert orchestrator["spec"]["replicas"] == 1
    spec = pod_specs(orchestrator)[0]
    # Its own small CPU image from the stack's orchestrator repository, at a class that never preempts.
    assert spec["containers"][0]["image"] == \
        "111111111111.dkr.ecr.us-east-1.amazonaws.com/moe-rl-dev/orchestrator:v0.1.0"
    assert spec["priorityClassName"] == cluster.ORCHESTRATOR_PRIORITY_CLASS
    assert pod_specs(orchestrator)[0]["containers"][0]["command"] == ["moerl", "orchestrate", "--run", "/etc/moerl/run.yaml",
                                                                      "--resume", "latest"]


def test_every_container_is_locked_down_and_sized(objects):
    found = containers(objects)
    assert len(found) == 2 * 2 * (3 + 2)  # per run: rollout, orchestrator, trainer + two validation jobs, each
    # with its startup check
    for c in found:
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000, c["name"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert "add" not in sc["capabilities"]  # nothing added, not even IPC_LOCK on EFA pods (pod security: restricted)
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
        repo, _, tag = c["image"].rpartition(":")
        assert repo.startswith("111111111111.dkr.ecr.us-east-1.amazonaws.com/") and tag == "v0.1.0"
    for obj in objects:
        for spec in pod_specs(obj):
            assert spec["automountServiceAccountToken"] is False
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def _allowed(policies: list[dict], pod_labels: dict, source: dict | str, port: int) -> bool:
    """NetworkPolicy ingress semantics for one namespace: a pod selected by any policy accepts only what some
    selecting policy's rule allows. `source` is a peer's labels, or an IP address string."""
    import ipaddress

    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for peer in rule.get("from", []):
                if isinstance(source, dict) and "podSelector" in peer and \
                        peer["podSelector"]["matchLabels"].items() <= source.items():
                    return True
                if isinstance(source, str) and "ipBlock" in peer and \
                        ipaddress.ip_address(source) in ipaddress.ip_network(peer["ipBlock"]["cidr"]):
                    return True
    return False


def test_network_policy_admits_exactly_the_runs_edges(manifests):
    from moe_rl_eks.k8s.run_chart import role_labels

    run = "qwen3-30b-a3b-p5"
    policies = [d for d in manifests[f"{run}/run.k8s.yaml"] if d["kind"] == "NetworkPolicy"]
    pods = {r: role_labels(run, r) for r in ("rollout", "orchestrator", "trainer")}
    stranger = role_labels("other-run", "orchestrator")
    ports = {"rollout": cluster.ROLLOUT_PORT, "orchestrator": cluster.ORCHESTRATOR_PORT, "trainer": 12345}
    allowed = {(src, dst) for src in [*pods, "stranger"] for dst in pods
               if _allowed(policies, pods[dst], stranger if src == "stranger" else pods[src], ports[dst])}
    assert allowed == {("orchestrator", "rollout"), ("trainer", "orchestrator"), ("orchestrator", "trainer"),
                       ("trainer", "trainer")}
    scraper = "10.20.96.20"  # in the dev stack's scraper subnets (the ScraperSubnetCidrs output)
    other_pod = "10.20.7.9"  # any other pod of the cluster: its IP is in the nodes' private subnets
    for role, metrics_port in (("rollout", cluster.ROLLOUT_PORT), ("orchestrator", cluster.ORCHESTRATOR_PORT),
                               ("trainer", cluster.TRAINER_METRICS_PORT)):
        assert _allowed(policies, pods[role], scraper, metrics_port)
        assert not _allowed(policies, pods[role], other_pod, metrics_port)  # port 8000 also loads weights
        assert not _allowed(policies, pods[role], "192.168.1.1", metrics_port)
    assert not _allowed(policies, pods["trainer"], scraper, cluster.TRAINER_RENDEZVOUS_PORT)


def test_every_container_knows_its_region_without_instance_metadata(objects):
    for c in containers(objects):
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1", c["name"]


def test_run_pods_may_not_reach_the_instance_metadata_service(manifests):
    import ipaddress

    from moe_rl_eks.k8s.run_chart import role_labels

    run = "qwen3-30b-a3b-p5"
    (policy,) = [d for d in manifests[f"{run}/run.k8s.yaml"] if d["kind"] == "NetworkPolicy"
                 and "Egress" in d["spec"]["policyTypes"]]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    for role in ("rollout", "orchestrator", "trainer", "validation"):  # every pod of the run, validation jobs too
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= role_labels(run, role).items()
    (rule,) = policy["spec"]["egress"]
    (peer,) = rule["to"]

    def reachable(ip: str) -> bool:
        block = peer["ipBlock"]
        return ipaddress.ip_address(ip) in ipaddress.ip_network(block["cidr"]) and \
            not any(ipaddress.ip_address(ip) in ipaddress.ip_network(c) for c in block["except"])

    assert not reachable("169.254.169.254")  # instance metadata: the node role's credentials
    assert reachable("169.254.170.23")  # the Pod Identity agent
    assert reachable("10.20.7.9") and reachable("52.95.110.1") and "ports" not in rule


@pytest.mark.parametrize("run", CLUSTER_RUNS)
def test_every_pod_starts_only_after_moerl_doctor_passes_in_its_own_image(manifests, run):
    docs = manifests[f"{run}/run.k8s.yaml"] + manifests[f"{run}/validation.k8s.yaml"]
    checked = 0
    for obj in docs:
        for spec in pod_specs(obj):
            (main,) = spec["containers"]
            (doctor,) = spec["initContainers"]
            role = obj["metadata"]["labels"]["moe-rl/role"]
            expected_role = "trainer" if role == "validation" else role
            efa = "vpc.amazonaws.com/efa" in main["resources"]["limits"]
            assert doctor["command"] == ["moerl", "doctor", "--role", expected_role, *(["--efa"] if efa else [])]
            # Same image, devices, limits, security and mounts: it checks what the main container will get.
            for field in ("image", "resources", "securityContext", "volumeMounts"):
                assert doctor[field] == main[field], (obj["metadata"]["name"], field)
            checked += 1
    assert checked == 5  # rollout, orchestrator, trainer, nccl-check, ep-bench


def test_validation_chart_runs_nccl_and_ep_benchmarks_on_the_trainer_gang(manifests):
    docs = manifests["qwen3-30b-a3b-p5/validation.k8s.yaml"]
    nccl = find(docs, "JobSet", "qwen3-30b-a3b-p5-nccl-check")
    ep = find(docs, "JobSet", "qwen3-30b-a3b-p5-ep-bench")
    for jobset in (nccl, ep):
        assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == cluster.TRAINER_QUEUE
        assert jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    (c,) = pod_specs(nccl)[0]["containers"]
    assert c["command"][-2:] == ["python", "/etc/moerl/collectives_check.py"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["FI_PROVIDER"] == "efa"  # the log names the selected provider
    (c,) = pod_specs(ep)[0]["containers"]
    assert c["command"][-2:] == ["moerl", "bench-ep"]
    script = find(docs, "ConfigMap", "qwen3-30b-a3b-p5-validate")["data"]["collectives_check.py"]
    assert "Selected provider is efa" in script


@pytest.mark.parametrize("kind, name, port", [
    ("Deployment", "qwen3-30b-a3b-p5-rollout", cluster.ROLLOUT_PORT),
    ("Deployment", "qwen3-30b-a3b-p5-orchestrator", cluster.ORCHESTRATOR_PORT),
    ("JobSet", "qwen3-30b-a3b-p5-trainer", cluster.TRAINER_METRICS_PORT),
])
def test_run_pods_are_annotated_for_the_managed_scraper_on_their_metrics_port(manifests, kind, name, port):
    obj = find(manifests["qwen3-30b-a3b-p5/run.k8s.yaml"], kind, name)
    template = obj["spec"]["template"] if kind == "Deployment" else \
        obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
    assert port in [p["containerPort"] for p in template["spec"]["containers"][0]["ports"]]


def test_scaler_query_selects_the_runs_orchestrator_by_the_pod_label_the_scraper_sets(manifests):
    scaler = find(manifests["qwen3-30b-a3b-p5/run.k8s.yaml"], "ScaledObject", "qwen3-30b-a3b-p5-rollout")
    assert scaler["spec"]["triggers"][0]["metadata"]["query"] == \
        'sum(moerl_rollout_queue_depth{pod=~"qwen3-30b-a3b-p5-orchestrator-.*"})'


@pytest.mark.parametrize("run", ["dev-small", "qwen3-30b-a3b-p5"])
def test_a_pod_resolves_the_shipped_run_to_the_same_backend(manifests, run):
    from moe_rl_eks.core.environment import load_environments
    from moe_rl_eks.core.run import RunConfig
    from moe_rl_eks.core.schema import parse

    data = find(manifests[f"{run}/run.k8s.yaml"], "ConfigMap", f"{run}-config")["data"]
    assert set(data) == {"run.yaml"}  # the typed, resolved run file alone: no cdk.json
    shipped = parse(RunConfig, yaml.safe_load(data["run.yaml"]), source="/etc/moerl/run.yaml")
    in_pod = resolve_run(shipped, None)  # what the trainer does in the pod, without any environment
    assert (in_pod.ep_backend, in_pod.topology) == (resolved(run).ep_backend, resolved(run).topology)
    assert shipped.environment is None and shipped.resolved.environment == "dev"
    assert shipped.resolved.trainer_instance_type == "p5.48xlarge"
    # Everything else is the run as written (the orchestrator's endpoints filled in when the file has none).
    original = load_run(run_file(run))
    assert replace(shipped, environment=original.environment, resolved=None, rl=original.rl) == original
    # Nothing of the environment's account, admin role or network reaches the cluster.
    environment = load_environments(json.loads((ROOT / "cdk.json").read_text())["context"])["dev"]
    for secret in (environment.admin_role_arn, environment.vpc_cidr, *environment.endpoint.public_cidrs):
        assert secret not in data["run.yaml"]


def test_a_resolved_run_file_takes_no_environment_and_refuses_a_backend_its_topology_cannot_run():
    from moe_rl_eks.core.ep_backends import Topology
    from moe_rl_eks.core.run import resolved_run_file
    from moe_rl_eks.core.schema import ConfigError

    ours = resolved("dev-small")
    shipped = resolved_run_file(ours)
    with pytest.raises(ConfigError, match="resolved by moerl manifests already; it takes no environment"):
        resolve_run(shipped, ours.environment)
    tampered = replace(shipped, resolved=replace(shipped.resolved, topology=Topology(2, 8, "cuda", 16)))
    with pytest.raises(ConfigError, match=r"resolved.ep_backend: 'deepep' is not allowed; .*deepep_efa: true"):
        resolve_run(tampered, None)
    with pytest.raises(ConfigError, match="a resolved run file names no environment"):
        from moe_rl_eks.core.run import RunConfig
        from moe_rl_eks.core.schema import dump, parse
        parse(RunConfig, {**dump(shipped), "environment": "dev"}, source="x")


def test_a_rollout_pod_has_tmp_room_for_one_downloaded_version_when_weights_live_in_s3(tmp_path):
    from moe_rl_eks.k8s.manifests import main

    data = yaml.safe_load(run_file("qwen3-30b-a3b-p5").read_text())
    data["rl"]["weights"] = {"kind": "s3", "bucket": "moe-rl-dev-artifacts-111111111111"}  # the stack bucket
    path = tmp_path / "qwen3-30b-a3b-p5.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["--run", str(path), "--outputs", str(EXAMPLE_OUTPUTS), "--out", str(tmp_path / "dist"),
                 "--cdk-json", str(ROOT / "cdk.json")]) == 0
    docs = [d for d in yaml.safe_load_all((tmp_path / "dist/dev/qwen3-30b-a3b-p5/run.k8s.yaml").read_text()) if d]
    (tmp,) = [v for v in pod_specs(find(docs, "Deployment", "qwen3-30b-a3b-p5-rollout"))[0]["volumes"]
              if v["name"] == "tmp"]
    assert tmp["emptyDir"]["sizeLimit"] == "65Gi"  # 8 Gi of scratch + 57 Gi (30.5 B bf16 parameters)


def test_a_run_claiming_an_efa_capable_deepep_makes_the_startup_check_verify_the_image(tmp_path, manifests):
    from moe_rl_eks.core.container import DEEPEP_EFA_ENV
    from moe_rl_eks.k8s.manifests import main

    def trainer_envs(docs: list[dict], run: str) -> list[dict]:
        (spec,) = pod_specs(find(docs, "JobSet", f"{run}-trainer"))
        return [{e["name"]: e.get("value") for e in c["env"]} for c in spec["containers"] + spec["initContainers"]]

    assert all(DEEPEP_EFA_ENV not in env for env in trainer_envs(manifests["qwen3-30b-a3b-p5/run.k8s.yaml"],
                                                                 "qwen3-30b-a3b-p5"))
    data = yaml.safe_load(run_file("qwen3-30b-a3b-p5").read_text())
    data["deploy"]["images"]["deepep_efa"] = True
    path = tmp_path / "qwen3-30b-a3b-p5.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["--run", str(path), "--outputs", str(EXAMPLE_OUTPUTS), "--out", str(tmp_path / "dist"),
                 "--cdk-json", str(ROOT / "cdk.json")]) == 0
    docs = [d for d in yaml.safe_load_all((tmp_path / "dist/dev/qwen3-30b-a3b-p5/run.k8s.yaml").read_text()) if d]
    assert [env[DEEPEP_EFA_ENV] for env in trainer_envs(docs, "qwen3-30b-a3b-p5")] == ["1", "1"]  # trainer, doctor


def test_run_pods_tolerate_exactly_their_pools_taints_no_execute_included(tmp_path, manifests):
    from moe_rl_eks.k8s.manifests import main

    def tolerations(docs: list[dict], kind: str, name: str) -> list[list[dict]]:
        return [spec["tolerations"] for spec in pod_specs(find(docs, kind, name))]

    no_schedule = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    shipped = manifests["qwen3-30b-a3b-p5/run.k8s.yaml"]
    assert tolerations(shipped, "JobSet", "qwen3-30b-a3b-p5-trainer") == [no_schedule]
    cdk = json.loads((ROOT / "cdk.json").read_text())
    cdk["context"]["environments"]["dev"]["trainer_pool"]["taint_effect"] = "NO_EXECUTE"
    (tmp_path / "cdk.json").write_text(json.dumps(cdk))
    assert main(["--run", str(run_file("qwen3-30b-a3b-p5")), "--outputs", str(EXAMPLE_OUTPUTS),
                 "--out", str(tmp_path / "dist"), "--cdk-json", str(tmp_path / "cdk.json")]) == 0
    docs = [d for d in yaml.safe_load_all((tmp_path / "dist/dev/qwen3-30b-a3b-p5/run.k8s.yaml").read_text()) if d]
    no_execute = [{**no_schedule[0], "effect": "NoExecute"}]
    assert tolerations(docs, "JobSet", "qwen3-30b-a3b-p5-trainer") == [no_execute]
    assert tolerations(docs, "Deployment", "qwen3-30b-a3b-p5-rollout") == [no_schedule]  # its own pool's taint


def test_validation_pods_carry_their_own_metadata_block_applied_before_the_run(manifests):
    from moe_rl_eks.k8s.run_chart import role_labels

    run = "qwen3-30b-a3b-p5"
    (policy,) = [d for d in manifests[f"{run}/validation.k8s.yaml"] if d["kind"] == "NetworkPolicy"
                 and "Egress" in d["spec"]["policyTypes"]]
    assert policy["metadata"]["name"] == f"{run}-validation-no-instance-metadata"  # not the run's own policy
    assert policy["spec"]["podSelector"]["matchLabels"] == {labels.RUN_LABEL: run, labels.ROLE_LABEL: "validation"}
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= role_labels(run, "validation").items()
    (rule,) = policy["spec"]["egress"]
    assert rule["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}}]


def test_rollout_pods_request_no_efa_on_an_efa_pool(manifests):
    # Whatever the pool (EFA pools: tests/k8s/test_pod_resources.py), a server spans one node's GPUs only.
    for run in CLUSTER_RUNS:
        (spec,) = pod_specs(find(manifests[f"{run}/run.k8s.yaml"], "Deployment", f"{run}-rollout"))
        for c in spec["containers"] + spec["initContainers"]:
            assert labels.EFA_RESOURCE not in c["resources"]["requests"], (run, c["name"])
        assert "--efa" not in spec["initContainers"][0]["command"]


def test_a_cluster_with_its_own_queue_and_priority_class_names_gets_runs_that_use_them(tmp_path):
    """The names come from the environment's cluster_names, the setting infra.ClusterServices creates them from."""
    from moe_rl_eks.k8s.manifests import main

    cdk_json = json.loads((ROOT / "cdk.json").read_text())
    cdk_json["context"]["environments"]["dev"]["cluster_names"] = {
        "trainer_queue": "research-gpus", "trainer_priority_class": "research-trainer",
        "orchestrator_priority_class": "research-orchestrator", "rollout_priority_class": "research-rollout"}
    (tmp_path / "cdk.json").write_text(json.dumps(cdk_json))
    assert main(["--run", str(run_file("qwen3-30b-a3b-p5")), "--outputs", str(EXAMPLE_OUTPUTS),
                 "--out", str(tmp_path / "dist"), "--cdk-json", str(tmp_path / "cdk.json")]) == 0
    docs = [d for d in yaml.safe_load_all((tmp_path / "dist/dev/qwen3-30b-a3b-p5/run.k8s.yaml").read_text()) if d]
    trainer = find(docs, "JobSet", "qwen3-30b-a3b-p5-trainer")
    assert trainer["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research-gpus"
    assert {s["priorityClassName"] for s in pod_specs(trainer)} == {"research-trainer"}
    assert pod_specs(find(docs, "Deployment", "qwen3-30b-a3b-p5-rollout"))[0]["priorityClassName"] == "research-rollout"
    assert pod_specs(find(docs, "Deployment", "qwen3-30b-a3b-p5-orchestrator"))[0]["priorityClassName"] == \
        "research-orchestrator"
