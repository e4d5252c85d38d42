"""One RL run on a cluster built by infra/: rollout pool, orchestrator, gang-scheduled trainers, network policy.

The in-cluster objects the run only references (namespace, service accounts, FSx claim, Kueue queues,
PriorityClasses) are named in core.cluster; values known only after `cdk deploy` come from the stack outputs.
"""
from __future__ import annotations

import math
from dataclasses import replace

import cdk8s
import yaml
from constructs import Construct

from moe_rl_eks.core import cluster, labels, metrics
from moe_rl_eks.core.launch import launch
from moe_rl_eks.core.deploy import image_reference
from moe_rl_eks.core.run import ResolvedRun, resolved_run_file
from moe_rl_eks.core.schema import dump

from .kube import k8s
from .outputs import StackOutputs
from .pods import CACHE_ENV, ORCHESTRATOR_SIZE, PULL_POLICY, RUN_FILE, TMP_GIB, aws_env, check_shm, \
    container_security, env_vars, gpu_placement, pod_spec, rollout_size, scraped_on, \
    standard_volumes, startup_check
from .trainer import GangJob, add_gang_job

KEDA_API = "keda.sh/v1alpha1"
ROLES = ("rollout", "orchestrator", "trainer")
# The instance metadata service: its node credentials are not for run pods (they use Pod Identity, whose agent
# listens on 169.254.170.23 and stays reachable).
IMDS_CIDR = "169.254.169.254/32"


def role_labels(run: str, role: str) -> dict[str, str]:
    """Pod labels; network policies and selectors match on (run, role)."""
    return {labels.RUN_LABEL: run, labels.ROLE_LABEL: role, labels.APP_NAME_LABEL: f"{run}-{role}",
            labels.PART_OF_LABEL: labels.PART_OF}


def selector(run: str, role: str | None = None) -> dict[str, str]:
    return {labels.RUN_LABEL: run, **({labels.ROLE_LABEL: role} if role else {})}


def config_map_name(run: str) -> str:
    return f"{run}-config"


def orchestrator_url(run: str, namespace: str) -> str:
    return f"http://{run}-orchestrator.{namespace}.svc.cluster.local:{cluster.ORCHESTRATOR_PORT}"


def rollout_url(run: str, namespace: str) -> str:
    """The rollout servers' headless Service: its DNS name resolves to every ready server, and `dns+http` makes the
    orchestrator re-resolve it and treat each address as its own server (spread, retries, straggler hedging)."""
    return f"dns+http://{run}-rollout.{namespace}.svc.cluster.local:{cluster.ROLLOUT_PORT}"


def queue_depth_query(run: str) -> str:
    # The managed scraper keeps only the run namespace's pods and labels each series with its pod's name
    # (infra/observability.py), so the orchestrator's pod name prefix picks this run's series.
    return f'sum({metrics.ROLLOUT_QUEUE_DEPTH.name}{{pod=~"{run}-orchestrator-.*"}})'


def weight_secret(run: str) -> str:
    return f"{run}-weight-token"


class RunChart(cdk8s.Chart):
    def __init__(self, scope: Construct, id: str, *, resolved: ResolvedRun, outputs: StackOutputs, source: str):
        env = resolved.environment
        assert env is not None and resolved.run.deploy is not None, "resolve_run checked this is a cluster run"
        super().__init__(scope, id, namespace=env.run_namespace, disable_resource_name_hashes=True)
        self.resolved, self.outputs, self.source = resolved, outputs, source
        run, deploy = resolved.run, resolved.run.deploy
        self.name = run.name
        self.trainer_image = image_reference(outputs.trainer_repository_uri, deploy.images.trainer)
        self.rollout_image = image_reference(outputs.rollout_repository_uri, deploy.images.rollout)
        self.orchestrator_image = image_reference(outputs.orchestrator_repository_uri, deploy.images.orchestrator)
        # Only the orchestrator and the rollout servers use the weight-load token.
        self.secret_env = (run.rl.weight_token_env, weight_secret(run.name), "token")
        self.run_env = {**CACHE_ENV, **aws_env(env.region)}

        self._config_map()
        self._rollout()
        self._orchestrator()
        add_gang_job(self, resolved, GangJob(
            name=f"{self.name}-trainer", image=self.trainer_image, command=["moerl", "train", "--run", RUN_FILE],
            pod_labels=role_labels(self.name, "trainer"), config_map=config_map_name(self.name),
            max_restarts=deploy.trainer_max_restarts, shm_gib=deploy.trainer_shm_gib,
            extra_env={**self.run_env, "MOERL_ORCHESTRATOR": orchestrator_url(self.name, self.namespace)},
            pod_annotations=scraped_on(cluster.TRAINER_METRICS_PORT)))
        self._network_policies()

    def _config_map(self) -> None:
        """The run file the pods read: the run as resolved here (EP backend, topology, instance types) with the
        orchestrator pointed at the rollout Service. It carries no environment: the account, admin role and
        network of cdk.json stay out of the cluster, and every pod resolves the EP backend chosen here."""
        run = self.resolved.run
        orchestrator = run.rl.orchestrator
        if not orchestrator.endpoints:
            run = replace(run, rl=replace(run.rl, orchestrator=replace(
                orchestrator, endpoints=(rollout_url(self.name, self.namespace),))))
        shipped = dump(resolved_run_file(self.resolved, run))
        k8s.KubeConfigMap(self, "config", metadata=k8s.ObjectMeta(name=config_map_name(self.name)),
                          data={"run.yaml": yaml.safe_dump(shipped, sort_keys=False)})

    def _rollout(self) -> None:
        run, env = self.resolved.run, self.resolved.environment
        deploy, rollout = run.deploy, run.rollout
        size = rollout_size(env.rollout_pool, rollout.gpus_per_server)
        check_shm(size, deploy.rollout_shm_gib, "deploy.rollout_shm_gib", self.source)
        name, pod_labels = f"{self.name}-rollout", role_labels(self.name, "rollout")
        # A version in S3 is downloaded to /tmp before the server's ranks read it: room for one more copy.
        download_gib = math.ceil(run.model.weights_gib) if run.rl.weights.kind == "s3" else 0
        # Routing replay: the servers write each choice's routed experts to the routing store (rl.routing), the one
        # directory of the FSx volume they write; the orchestrator deletes and the trainers read there.
        routing = (run.rl.routing.directory(run.rl.training.output_directory(run.name))
                   if run.rl.algorithm.routing_replay else None)
        volumes = standard_volumes(config_map_name(self.name), shm_gib=deploy.rollout_shm_gib, fsx_read_only=True,
                                   tmp_gib=TMP_GIB + download_gib, fsx_writable=routing)
        # /health: the engine loop is alive (liveness); /ready: a weight version is loaded, so the headless
        # Service lists the server to the orchestrator only once it can answer.
        health = k8s.HttpGetAction(path="/health", port=k8s.IntOrString.from_string("http"))
        ready = k8s.HttpGetAction(path="/ready", port=k8s.IntOrString.from_string("http"))
        container = k8s.Container(
            name="server",
            image=self.rollout_image,
            image_pull_policy=PULL_POLICY,
            command=launch(["moerl", "serve-rollout", "--run", RUN_FILE, "--port", str(cluster.ROLLOUT_PORT)],
                           processes=rollout.gpus_per_server),
            env=env_vars(self.run_env, self.secret_env),
            ports=[k8s.ContainerPort(name="http", container_port=cluster.ROLLOUT_PORT)],
            resources=size.resources(),
            security_context=container_security(),
            volume_mounts=volumes.mounts,
            # Building the model takes minutes before the server answers: liveness waits for the startup probe (the
            # weights load behind /ready).
            startup_probe=k8s.Probe(http_get=health, period_seconds=10, failure_threshold=90),
            readiness_probe=k8s.Probe(http_get=ready, period_seconds=5, failure_threshold=2),
            liveness_probe=k8s.Probe(http_get=health, period_seconds=20, failure_threshold=3, timeout_seconds=5),
            # Endpoints drop a terminating pod asynchronously: keep serving in-flight and late requests first.
            lifecycle=k8s.Lifecycle(pre_stop=k8s.LifecycleHandler(
                sleep=k8s.SleepAction(seconds=deploy.rollout_drain_seconds))),
        )
        match = k8s.LabelSelector(match_labels=selector(self.name, "rollout"))
        pod = pod_spec(
            container, volumes, service_account=cluster.ROLLOUT_SERVICE_ACCOUNT,
            priority_class=env.cluster_names.rollout_priority_class,
            init_containers=[startup_check(container, "rollout", efa=False)],  # rollout pods take no EFA
            termination_grace_period_seconds=deploy.rollout_drain_seconds + 30,
            # Spread servers over nodes: one lost node takes few of them.
            topology_spread_constraints=[k8s.TopologySpreadConstraint(
                max_skew=1, topology_key="kubernetes.io/hostname", when_unsatisfiable="ScheduleAnyway",
                label_selector=match)],
            **gpu_placement("rollout", env.rollout_pool))
        spec = k8s.DeploymentSpec(
            # Under autoscaling KEDA owns the replica count; a `replicas` here would fight it.
            replicas=None if rollout.autoscaled else rollout.min_servers,
            selector=match,
            # The GPUs are taken: replace servers one at a time instead of surging.
            strategy=k8s.DeploymentStrategy(type="RollingUpdate", rolling_update=k8s.RollingUpdateDeployment(
                max_surge=k8s.IntOrString.from_number(0), max_unavailable=k8s.IntOrString.from_number(1))),
            template=k8s.PodTemplateSpec(
                metadata=k8s.ObjectMeta(labels=pod_labels, annotations=scraped_on(cluster.ROLLOUT_PORT)), spec=pod))
        k8s.KubeDeployment(self, "rollout", metadata=k8s.ObjectMeta(name=name, labels=pod_labels), spec=spec)
        k8s.KubeService(self, "rollout-service", metadata=k8s.ObjectMeta(name=name, labels=pod_labels),
                        spec=k8s.ServiceSpec(cluster_ip="None", selector=selector(self.name, "rollout"),
                                             ports=[k8s.ServicePort(name="http", port=cluster.ROLLOUT_PORT,
                                                                    target_port=k8s.IntOrString.from_string("http"))]))
        k8s.KubePodDisruptionBudget(self, "rollout-pdb", metadata=k8s.ObjectMeta(name=name, labels=pod_labels),
                                    spec=k8s.PodDisruptionBudgetSpec(max_unavailable=k8s.IntOrString.from_number(1),
                                                                     selector=match))
        if rollout.autoscaled:
            self._autoscaler(name, pod_labels)

    def _autoscaler(self, deployment: str, pod_labels: dict[str, str]) -> None:
        """KEDA scales the rollout servers on the orchestrator's backlog (queued + in-flight requests), read
        from Amazon Managed Prometheus with SigV4 under the KEDA operator's Pod Identity role."""
        run, env = self.resolved.run, self.resolved.environment
        assert self.outputs.prometheus_endpoint, "checked when the outputs were loaded"
        auth = cdk8s.ApiObject(self, "amp-auth", api_version=KEDA_API, kind="TriggerAuthentication",
                               metadata=cdk8s.ApiObjectMetadata(name=f"{self.name}-amp", labels=pod_labels))
        auth.add_json_patch(cdk8s.JsonPatch.add("/spec", {"podIdentity": {"provider": "aws"}}))
        scaled = cdk8s.ApiObject(self, "rollout-scaler", api_version=KEDA_API, kind="ScaledObject",
                                 metadata=cdk8s.ApiObjectMetadata(name=deployment, labels=pod_labels))
        scaled.add_json_patch(cdk8s.JsonPatch.add("/spec", {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicaCount": run.rollout.min_servers,
            "maxReplicaCount": run.rollout.max_servers,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            # New servers take minutes to load weights: scale down slowly so a burst does not thrash them.
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": 600}}}},
            "triggers": [{
                "type": "prometheus",
                "authenticationRef": {"name": f"{self.name}-amp"},
                "metadata": {
                    "serverAddress": self.outputs.prometheus_endpoint,
                    "awsRegion": env.region,
                    "identityOwner": "operator",
                    "query": queue_depth_query(self.name),
                    # Target backlog per server: one full decoding batch waiting for each.
                    # queue depth counts requests; each server holds max_inflight_requests at a time
                    "threshold": str(run.rl.orchestrator.max_inflight_requests),
                    "ignoreNullValues": "false",  # a lost metric is an error, not "scale to min"
                },
            }],
        }))

    def _orchestrator(self) -> None:
        name, pod_labels = f"{self.name}-orchestrator", role_labels(self.name, "orchestrator")
        volumes = standard_volumes(config_map_name(self.name), shm_gib=None, fsx_read_only=False)
        health = k8s.HttpGetAction(path="/health", port=k8s.IntOrString.from_string("http"))
        container = k8s.Container(
            name="orchestrator",
            image=self.orchestrator_image,
            image_pull_policy=PULL_POLICY,
            # A restarted pod picks up where the trainers' newest checkpoint left the prompt cursor.
            command=["moerl", "orchestrate", "--run", RUN_FILE, "--resume", "latest"],
            env=env_vars(self.run_env, self.secret_env),
            ports=[k8s.ContainerPort(name="http", container_port=cluster.ORCHESTRATOR_PORT)],
            resources=ORCHESTRATOR_SIZE.resources(),
            security_context=container_security(),
            volume_mounts=volumes.mounts,
            readiness_probe=k8s.Probe(http_get=health, period_seconds=10),
            liveness_probe=k8s.Probe(http_get=health, period_seconds=20, failure_threshold=3, timeout_seconds=5),
        )
        k8s.KubeDeployment(self, "orchestrator", metadata=k8s.ObjectMeta(name=name, labels=pod_labels),
                           spec=k8s.DeploymentSpec(
                               replicas=1,  # it owns the run's single queue and step counter
                               strategy=k8s.DeploymentStrategy(type="Recreate"),
                               selector=k8s.LabelSelector(match_labels=selector(self.name, "orchestrator")),
                               template=k8s.PodTemplateSpec(
                                   metadata=k8s.ObjectMeta(labels=pod_labels,
                                                           annotations=scraped_on(cluster.ORCHESTRATOR_PORT)),
                                   spec=pod_spec(
                                       container, volumes, service_account=cluster.ORCHESTRATOR_SERVICE_ACCOUNT,
                                       # Above rollout servers, and it never preempts: it shares the system
                                       # nodes with the cluster's controllers.
                                       priority_class=self.resolved.environment.cluster_names.orchestrator_priority_class,
                                       init_containers=[startup_check(container, "orchestrator", efa=False)]))))
        k8s.KubeService(self, "orchestrator-service", metadata=k8s.ObjectMeta(name=name, labels=pod_labels),
                        spec=k8s.ServiceSpec(selector=selector(self.name, "orchestrator"),
                                             ports=[k8s.ServicePort(name="http", port=cluster.ORCHESTRATOR_PORT,
                                                                    target_port=k8s.IntOrString.from_string("http"))]))

    def _network_policies(self) -> None:
        """Deny all ingress to the run's pods, then allow exactly: orchestrator -> rollout, orchestrator <->
        trainers, trainer <-> trainer, and the managed Prometheus scraper -> the /metrics ports. Egress is open
        except to the instance metadata service.

        The scraper is agentless: it reaches pods from network interfaces in subnets of its own (infra/network.py),
        whose CIDRs are a stack output; nothing else lives there. Those ports also serve the weight-load endpoint,
        so no wider source is admitted (the kubelet's probes come from the node, which the CNI always admits)."""

        def peers(*roles: str) -> list[k8s.NetworkPolicyPeer]:
            return [k8s.NetworkPolicyPeer(pod_selector=k8s.LabelSelector(match_labels=selector(self.name, r)))
                    for r in roles]

        def tcp(*ports: int) -> list[k8s.NetworkPolicyPort]:
            return [k8s.NetworkPolicyPort(protocol="TCP", port=k8s.IntOrString.from_number(p)) for p in ports]

        rules = {
            "default-deny": (None, []),
            "rollout-from-orchestrator": ("rollout", [k8s.NetworkPolicyIngressRule(
                from_=peers("orchestrator"), ports=tcp(cluster.ROLLOUT_PORT))]),
            "orchestrator-from-trainer": ("orchestrator", [k8s.NetworkPolicyIngressRule(
                from_=peers("trainer"), ports=tcp(cluster.ORCHESTRATOR_PORT))]),
            # NCCL's bootstrap and torch.distributed use ephemeral ports between ranks: no port list.
            "trainer-from-trainer-and-orchestrator": ("trainer", [k8s.NetworkPolicyIngressRule(
                from_=peers("trainer", "orchestrator"))]),
        }
        if self.outputs.scraper_cidrs:
            rules["metrics-from-scraper"] = (None, [k8s.NetworkPolicyIngressRule(
                from_=[k8s.NetworkPolicyPeer(ip_block=k8s.IpBlock(cidr=c)) for c in self.outputs.scraper_cidrs],
                ports=tcp(cluster.ROLLOUT_PORT, cluster.ORCHESTRATOR_PORT, cluster.TRAINER_METRICS_PORT))])
        for policy, (role, ingress) in rules.items():
            k8s.KubeNetworkPolicy(self, f"netpol-{policy}",
                                  metadata=k8s.ObjectMeta(name=f"{self.name}-{policy}",
                                                          labels={labels.RUN_LABEL: self.name}),
                                  spec=k8s.NetworkPolicySpec(
                                      pod_selector=k8s.LabelSelector(match_labels=selector(self.name, role)),
                                      policy_types=["Ingress"], ingress=ingress))
        no_metadata_egress(self, self.name)


def no_metadata_egress(scope: Construct, run: str, role: str | None = None) -> k8s.KubeNetworkPolicy:
    """Egress anywhere but the instance metadata service, for every pod of the run, or only its `role`'s pods
    (the validation chart is applied before the run's and deleted on its own, so it carries its own): the node's
    credentials and user data stay out of reach (IMDSv2's hop limit of 2 admits containers)."""
    name = f"{run}-{role}-no-instance-metadata" if role else f"{run}-no-instance-metadata"
    return k8s.KubeNetworkPolicy(
        scope, "netpol-no-instance-metadata",
        metadata=k8s.ObjectMeta(name=name, labels={labels.RUN_LABEL: run}),
        spec=k8s.NetworkPolicySpec(
            pod_selector=k8s.LabelSelector(match_labels=selector(run, role)), policy_types=["Egress"],
            egress=[k8s.NetworkPolicyEgressRule(to=[k8s.NetworkPolicyPeer(
                ip_block=k8s.IpBlock(cidr="0.0.0.0/0", except_=[IMDS_CIDR]))])]))
