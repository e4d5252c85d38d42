"""A gang-scheduled multi-node torchrun job: a JobSet admitted through the trainer pool's Kueue queue.

Why a JobSet through Kueue: an EP/DP group cannot make progress until every rank has joined, so admitting some
trainer pods and not others only holds GPUs idle (and two half-admitted runs can deadlock each other). Kueue
admits the JobSet as one workload once the trainer ClusterQueue has quota for all its pods, and JobSet's failure
policy recreates the whole gang when any pod fails, so a lost node restarts the job from its last checkpoint
instead of leaving the survivors hanging in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import cdk8s
from constructs import Construct

from moe_rl_eks.core import cluster
from moe_rl_eks.core.container import DEEPEP_EFA_ENV
from moe_rl_eks.core.run import ResolvedRun

from .collectives import collective_env
from .kube import k8s
from .pods import CACHE_ENV, PULL_POLICY, container_security, env_vars, gpu_placement, \
    pod_spec, standard_volumes, startup_check, trainer_size

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REPLICATED_JOB = "node"


@dataclass(frozen=True)
class GangJob:
    name: str  # JobSet name, its headless Service and the c10d rendezvous id
    image: str
    command: list[str]  # what torchrun starts on every rank (with --no-python)
    pod_labels: dict[str, str]
    config_map: str
    max_restarts: int
    shm_gib: int
    extra_env: dict[str, str]
    secret_env: tuple[str, str, str] | None = None
    pod_annotations: dict[str, str] | None = None


def torchrun_command(resolved: ResolvedRun, job_name: str, command: list[str]) -> list[str]:
    """torchrun on every node, meeting at pod 0 of the JobSet through its headless Service (c10d rendezvous).

    --max-restarts=0: a failed rank fails the pod, and JobSet restarts the whole gang from its checkpoint; one
    restart mechanism, not two fighting each other. `--` ends torchrun's options: without it torchrun reads the
    command's own flags as abbreviations of its own (`--run` as `--run-path`)."""
    topo = resolved.topology
    rendezvous_host = f"{job_name}-{REPLICATED_JOB}-0-0.{job_name}"
    return ["torchrun", f"--nnodes={topo.nodes}", f"--nproc-per-node={topo.ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_host}:{cluster.TRAINER_RENDEZVOUS_PORT}",
            f"--rdzv-id={job_name}", "--max-restarts=0", "--no-python", "--", *command]


TERMINATION_GRACE_SECONDS = 120  # SIGTERM (preemption) writes a checkpoint before the pod is killed


def add_gang_job(scope: Construct, resolved: ResolvedRun, job: GangJob) -> None:
    env = resolved.environment
    assert env is not None, "gang jobs run on a cluster"
    size = trainer_size(env.trainer_pool)
    nodes = resolved.topology.nodes
    volumes = standard_volumes(job.config_map, shm_gib=job.shm_gib, fsx_read_only=False)
    variables = {**CACHE_ENV, **collective_env(env.trainer_pool.instance_type, resolved.ep_backend),
                 "MOERL_EP_BACKEND": resolved.ep_backend,
                 # The run says its image's DeepEP runs over EFA: the startup check refuses an image that does not.
                 **({DEEPEP_EFA_ENV: "1"} if resolved.run.deploy.images.deepep_efa else {}),
                 # torchrun SIGKILLs its workers this long after forwarding SIGTERM (default 30 s): leave the
                 # checkpoint-on-SIGTERM most of the pod's grace period.
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(TERMINATION_GRACE_SECONDS - 10), **job.extra_env}
    container = k8s.Container(
        name="trainer",
        image=job.image,
        image_pull_policy=PULL_POLICY,
        command=torchrun_command(resolved, job.name, job.command),
        env=env_vars(variables, job.secret_env),
        ports=[k8s.ContainerPort(name="rendezvous", container_port=cluster.TRAINER_RENDEZVOUS_PORT),
               k8s.ContainerPort(name="metrics", container_port=cluster.TRAINER_METRICS_PORT)],
        resources=size.resources(),
        security_context=container_security(),
        volume_mounts=volumes.mounts,
    )
    pod = pod_spec(container, volumes, service_account=cluster.TRAINER_SERVICE_ACCOUNT,
                   priority_class=env.cluster_names.trainer_priority_class, restart_policy="Never",
                   init_containers=[startup_check(container, "trainer", efa=bool(size.efa))],
                   termination_grace_period_seconds=TERMINATION_GRACE_SECONDS,
                   **gpu_placement("trainer", env.trainer_pool))
    job_spec = k8s.JobSpec(
        parallelism=nodes, completions=nodes, completion_mode="Indexed", backoff_limit=0,
        template=k8s.PodTemplateSpec(metadata=k8s.ObjectMeta(labels=job.pod_labels, annotations=job.pod_annotations),
                                     spec=pod))

    k8s.KubeService(scope, f"{job.name}-service", metadata=k8s.ObjectMeta(name=job.name, labels=job.pod_labels),
                    spec=k8s.ServiceSpec(
                        cluster_ip="None",
                        publish_not_ready_addresses=True,  # ranks rendezvous before any of them is ready
                        selector={"jobset.sigs.k8s.io/jobset-name": job.name},
                        ports=[k8s.ServicePort(
                            name="rendezvous", port=cluster.TRAINER_RENDEZVOUS_PORT,
                            target_port=k8s.IntOrString.from_number(cluster.TRAINER_RENDEZVOUS_PORT))]))
    jobset = cdk8s.ApiObject(scope, f"{job.name}-jobset", api_version=JOBSET_API, kind="JobSet",
                             metadata=cdk8s.ApiObjectMetadata(
                                 name=job.name,
                                 labels={**job.pod_labels, KUEUE_QUEUE_LABEL: env.cluster_names.queue("trainer")}))
    jobset.add_json_patch(cdk8s.JsonPatch.add("/spec", {
        "suspend": True,  # Kueue starts it once the whole gang is admitted
        "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
        "failurePolicy": {"maxRestarts": job.max_restarts, "restartStrategy": "Recreate"},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
        "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {
            "metadata": {"labels": job.pod_labels}, "spec": _json(k8s.KubeJob, spec=job_spec)["spec"]}}],
    }))


def _json(kube_class: type, **props) -> dict:
    """The JSON of a typed L1 object, for embedding in a custom resource (JobSet holds Job templates)."""
    scratch = cdk8s.Chart(cdk8s.App(), "scratch")
    return kube_class(scratch, "object", **props).to_json()
