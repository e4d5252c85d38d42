"""In-cluster services the run manifests rely on, installed through the kubectl provider with pinned Helm charts:
the NVIDIA and EFA device plugins (:class:`DevicePlugins`, usable on any cluster with a kubectl provider), and
KEDA, JobSet, Kueue (one ClusterQueue per GPU pool), Cluster Autoscaler (Pod Identity) and the PriorityClasses
(:class:`ClusterServices`).

Every chart is installed with Helm's ``--wait`` after the system nodes and CoreDNS exist, and the custom resources
a chart's webhooks guard (Kueue's queues) are applied only after it: the kubectl handler retries only timeouts, so a
webhook that does not answer yet would fail the deploy."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import Acknowledgment, Duration, Stack, Validations, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct, IDependable

from moe_rl_eks.core.catalog import CATALOG
from moe_rl_eks.core.cluster import (CLUSTER_SERVICES_PRIORITY_CLASS, HUGEPAGES_RESOURCE, KUBERNETES_VERSIONS,
                                    hugepages_mib, kubernetes_versions_allowed)
from moe_rl_eks.core.environment import ClusterNamesConfig, NodePoolConfig
from moe_rl_eks.core.labels import EFA_RESOURCE, GPU_RESOURCE, ROLE_LABEL, tolerations

from ._ids import pascal
from .checks import nag_partition
from .cluster import MoeRlCluster, service_account
from .node_pool import EfaNodePool


@dataclass(frozen=True)
class Chart:
    repository: str
    chart: str
    version: str
    namespace: str
    # The Kubernetes minors this release supports or was tested on: (lowest, highest; None: no upper bound stated),
    # and where that was read (source, date). Every Kubernetes version it is installed on must fall inside.
    kubernetes: tuple[str, str | None]
    kubernetes_source: str


def _keda(version: str, kubernetes: tuple[str, str], source: str) -> Chart:
    return Chart("https://kedacore.github.io/charts", "keda", version, "keda", kubernetes, source)


# Pinned chart versions, the same for every accepted Kubernetes version; bump deliberately (each is a cluster-wide
# upgrade). KEDA's follows the cluster's Kubernetes minor: KUBERNETES_PINS.
CHARTS = {
    "jobset": Chart("oci://registry.k8s.io/jobset/charts/jobset", "jobset", "0.12.0", "jobset-system", ("1.34", "1.36"),
                    "JobSet README at v0.12.0 (2026-05-08): the latest 3 minors; built on k8s.io/api v0.36.0"),
    "kueue": Chart("oci://registry.k8s.io/kueue/charts/kueue", "kueue", "0.19.2", "kueue-system", ("1.34", "1.36"),
                   "no window stated; v0.19.2 (2026-08-20) is built on k8s.io/api v0.36.2, read 2026-12-01"),
    "cluster-autoscaler": Chart("https://kubernetes.github.io/autoscaler", "cluster-autoscaler", "9.54.0",
                                "kube-system", ("1.35", "1.36"), "the chart states no window; its image is the "
                                "autoscaler release of the cluster's minor (KUBERNETES_PINS; autoscaler README: one "
                                "autoscaler minor per Kubernetes minor, read 2026-11)"),
    "nvidia-device-plugin": Chart("https://nvidia.github.io/k8s-device-plugin", "nvidia-device-plugin", "0.19.3",
                                  "kube-system", ("1.10", None), "chart kubeVersion '>= 1.10.0-0' at v0.19.3; "
                                  "kubelet device plugin API v1beta1 (read 2026-12-01)"),
    "aws-efa-k8s-device-plugin": Chart("https://aws.github.io/eks-charts", "aws-efa-k8s-device-plugin", "v0.5.6",
                                       "kube-system", ("1.10", None), "no window stated; kubelet device plugin API "
                                       "v1beta1 (read 2026-11)"),
}


@dataclass(frozen=True)
class KubernetesPins:
    """What the cluster services pin per Kubernetes minor: the KEDA release tested on it (each is tested on three
    minors, one later per release), and the Cluster Autoscaler image of the same minor (the autoscaler supports
    only the Kubernetes minor it is released for)."""

    keda: Chart
    cluster_autoscaler_image_tag: str


KUBERNETES_PINS = {
    "1.35": KubernetesPins(
        keda=_keda("2.20.2", ("1.33", "1.35"), "keda.sh/docs/2.22/operate/cluster, tested window per release "
                   "(read 2026-12-01)"),
        cluster_autoscaler_image_tag="v1.35.0"),
    # KEDA 2.21.0: the release's first version (keda-docs content/docs/2.21/deploy.md names v2.21.0's files); not
    # checked against the chart repository, whose index was not reachable, nor were the release's CRDs.
    "1.36": KubernetesPins(
        keda=_keda("2.21.0", ("1.34", "1.36"), "keda.sh/docs/2.22/operate/cluster, tested window per release "
                   "(read 2026-12-01)"),
        # Tag cluster-autoscaler-1.36.1 (2026-07-22), promoted to registry.k8s.io by kubernetes/k8s.io#9760.
        cluster_autoscaler_image_tag="v1.36.1"),
}
assert set(KUBERNETES_PINS) == set(KUBERNETES_VERSIONS), "an accepted Kubernetes version lacks its pins"


def pinned_charts(kubernetes_version: str) -> dict[str, Chart]:
    """Every chart installed on a cluster of ``kubernetes_version``: CHARTS and that minor's KEDA."""
    return {**CHARTS, "keda": KUBERNETES_PINS[kubernetes_version].keda}


KUEUE_API = "kueue.x-k8s.io/v1beta2"  # served from Kueue 0.15; v1beta1 is not served from 0.20
# Gang admission: a trainer JobSet is admitted only once the Cluster Autoscaler has scaled its pool up for every one
# of its pods in one step (Kueue's ProvisioningRequest admission check, kueue.x-k8s.io/provisioning-request). Until
# then its pods do not exist, so a run that cannot get all its nodes holds none. The atomic class asks for the whole
# gang in one node-group increase, made only when the group can hold all of it; AWS node groups do not implement
# the autoscaler's AtomicIncreaseSize (cluster-autoscaler 1.35 and 1.36 fall back to one plain increase), so EC2 may
# still launch fewer nodes than asked, and waitForPodsReady below gives such a gang back.
GANG_PROVISIONING = "moe-rl-gang"  # the ProvisioningRequestConfig and the AdmissionCheck naming it
PROVISIONING_CLASS = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
# The roles whose workloads are gangs (JobSets through Kueue): their ClusterQueues carry the admission check.
GANG_ROLES = ("trainer",)
# The ProvisioningRequest CRD (the autoscaler's chart installs neither the CRD nor the RBAC for it), from the 1.35.0
# release; the file's moe-rl/source annotation names the commit. 1.36.1's differs from it in description text only
# (two provisioning class names, compared 2026-12-02), so one CRD serves both pinned images.
PROVISIONING_REQUEST_CRD = Path(__file__).parent / "crds" / "autoscaling.x-k8s.io_provisioningrequests.json"
# An admitted gang must have every pod ready within this time (nodes launched from zero, the images pulled, each
# pod's doctor passed), or Kueue evicts all of it and requeues it after a backoff of 60 s doubling up to 1 h.
KUEUE_PODS_READY_TIMEOUT = "30m"


def kueue_configuration() -> dict:
    """Kueue's manager configuration, which replaces the chart's whole default: its probes, metrics, webhook and
    leader election as the chart at the pinned version sets them, the integrations used here, and waitForPodsReady. With scale-from-zero, quota alone admits
    a gang whose nodes may never all come: it would hold the nodes it got, and two such runs can each hold part of
    the pool forever. Here an admitted gang that is not all ready in time gives back every pod, and
    ``blockAdmission`` admits nothing else while one gang is still coming up, so at most one gang is ever partial."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"}, "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        # Only what runs here goes through Kueue; the chart registers webhooks for these alone.
        "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset"]},
        # Kueue's provisioning admission check (GA since Kueue 0.14, no feature gate) starts only if the
        # ProvisioningRequest API is served when Kueue starts: the CRD is applied before the chart (ClusterServices).
        "waitForPodsReady": {
            "timeout": KUEUE_PODS_READY_TIMEOUT, "blockAdmission": True,
            # Requeued without a limit: a run waits for capacity rather than being deactivated.
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600},
        },
    }
# Helm waits for the release's pods to be ready; the kubectl provider's Lambda runs at most 15 minutes.
CHART_TIMEOUT = Duration.minutes(12)
CLUSTER_AUTOSCALER_SERVICE_ACCOUNT = "cluster-autoscaler"
_SYSTEM_NODES = {ROLE_LABEL: "system"}
KEDA_OPERATOR_SERVICE_ACCOUNT = "keda-operator"  # the KEDA chart's default operator service account
# The JobSet chart names its controller `<fullname>-controller`; fullname is the release name when it contains the
# chart's name (charts/jobset/templates/controller/_helpers.tpl at v0.12.0).
JOBSET_CONTROLLER = "jobset-controller"
TRAINER_PRIORITY = 100_000
ORCHESTRATOR_PRIORITY = 50_000
ROLLOUT_PRIORITY = 10_000
# Controllers the run pods must never preempt (the orchestrator shares the system nodes with them).
_CRITICAL = CLUSTER_SERVICES_PRIORITY_CLASS


def require_kubectl_provider(cluster: eks.ICluster, user: str) -> None:
    """Charts and manifests go through the cluster's kubectl provider; without one aws-cdk-lib fails later with
    "Kubectl Provider is not defined in this cluster", naming neither the construct nor what to pass."""
    if cluster.kubectl_provider is None:
        raise ValueError(
            f"cluster: {cluster.node.path!r} is not allowed for {user}; it has no kubectl provider: import "
            "it with eks.Cluster.from_cluster_attributes(..., kubectl_provider=eks.KubectlProvider."
            "from_kubectl_provider_attributes(...)) to use an existing one, or with kubectl_provider_options="
            "eks.KubectlProviderOptions(kubectl_layer=...) to create one")


def add_chart(scope: Construct, cluster: eks.ICluster, pinned: Chart, values: dict,
              depends_on: Sequence[IDependable] = ()) -> eks.HelmChart:
    """A pinned chart, released under its own name, installed with Helm's --wait (so what depends on it finds it
    running)."""
    name = pinned.chart
    require_kubectl_provider(cluster, f"the {name} chart")
    chart = eks.HelmChart(scope, pascal(name), cluster=cluster, chart=name, repository=pinned.repository,
                          version=pinned.version, namespace=pinned.namespace, release=name, values=values,
                          create_namespace=True, wait=True, timeout=CHART_TIMEOUT)
    for dependency in depends_on:
        chart.node.add_dependency(dependency)
    return chart


class DevicePlugins(Construct):
    """The NVIDIA and EFA device plugins configured for EFA GPU pools, on any cluster with a kubectl provider (an
    imported one too). Attributes: ``charts`` (name -> HelmChart), ``tolerations`` (the plugins' DaemonSets')."""

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, pools: Sequence[EfaNodePool],
                 depends_on: Sequence[IDependable] = ()) -> None:
        """
        :param cluster: the cluster; it needs a kubectl provider (aws_eks_v2 ``kubectl_provider_options``).
        :param pools: the GPU pools the plugins serve: their DaemonSets tolerate every taint of these pools (a
            node whose taint they do not tolerate advertises no GPU or EFA, and GPU pods never land on it).
        :param depends_on: what must exist first (a new cluster's nodes and CoreDNS); default nothing.
        """
        super().__init__(scope, id)
        require_kubectl_provider(cluster, "DevicePlugins")
        if not pools or not all(isinstance(p, EfaNodePool) for p in pools):
            raise ValueError(f"pools: {list(pools)!r} is not allowed; one or more EfaNodePool, whose taints the "
                             "plugins tolerate")
        self.tolerations = tolerations(t for p in pools for t in p.taints)
        self.charts = {
            # Set explicitly, whatever the chart's default (0.19.0 turned all three on, 0.19.3 off again): MOFED
            # injection mounts every uverbs device into GPU pods, clashing with the EFA device plugin's allocation;
            # GDS is unused; GDRCopy passes /dev/gdrdrv into GPU containers (NVIDIA_GDRCOPY=enabled), which DeepEP's
            # NVSHMEM proxy over EFA needs, where the node loads the gdrdrv module (the EKS AMI does not).
            "nvidia-device-plugin": add_chart(self, cluster, CHARTS["nvidia-device-plugin"], {
                "mofedEnabled": False, "gdsEnabled": False, "gdrcopyEnabled": True,
                "tolerations": self.tolerations}, depends_on),
            # The plugin's own instance-type allow-list lags new types; without our types on it no node advertises
            # vpc.amazonaws.com/efa and NCCL silently falls back to TCP.
            "aws-efa-k8s-device-plugin": add_chart(self, cluster, CHARTS["aws-efa-k8s-device-plugin"], {
                "supportedInstanceLabels": {"keys": ["node.kubernetes.io/instance-type"],
                                            "values": sorted(n for n, t in CATALOG.items() if t.has_efa)},
                "tolerations": self.tolerations}, depends_on),
        }


class ClusterServices(Construct):
    """Cluster-wide services for runs. Attributes: ``charts`` (name -> HelmChart), ``device_plugins``,
    ``cluster_queues`` (pool role -> the ClusterQueue manifest), ``autoscaler_role``, ``pins`` (the
    :class:`KubernetesPins` of the cluster's version)."""

    def __init__(self, scope: Construct, id: str, *, cluster: MoeRlCluster | eks.ICluster,
                 pools: Mapping[str, EfaNodePool], run_namespace: str, kubernetes_version: str | None = None,
                 namespace_manifest: IDependable | None = None, keda_role: iam.IRole | None = None,
                 names: ClusterNamesConfig = ClusterNamesConfig(), depends_on: Sequence[IDependable] = ()) -> None:
        """
        :param cluster: a :class:`MoeRlCluster` (charts then wait for its ``services_ready``) or any
            ``eks.ICluster`` with a kubectl provider (an imported one: ``eks.Cluster.from_cluster_attributes(...,
            kubectl_provider=...)`` or ``kubectl_provider_options=...``), on which the EKS Pod Identity agent
            add-on runs (the autoscaler's and KEDA's AWS identities come through it).
        :param pools: GPU pools by role (``trainer``, ``rollout``); each gets a Kueue ResourceFlavor, ClusterQueue
            and LocalQueue.
        :param run_namespace: where LocalQueues live.
        :param kubernetes_version: the cluster's Kubernetes minor (one of core.cluster.KUBERNETES_VERSIONS), which
            picks KEDA's release and the autoscaler's image (KUBERNETES_PINS); default: a ``MoeRlCluster``'s own.
            Required with any other cluster: an ``eks.ICluster`` does not say its version.
        :param namespace_manifest: the run namespace's manifest, LocalQueues are created after it; default: none,
            the namespace exists already.
        :param keda_role: a Pod Identity role for the KEDA operator, whose scalers query Prometheus with the
            operator's own AWS identity; default: none (KEDA gets no AWS permissions).
        :param names: the queues' and PriorityClasses' names, which a run's manifests read from the same
            environment setting (``cluster_names``); default ``ClusterNamesConfig()``: ``moe-rl-trainer``,
            ``moe-rl-rollout``, ``moe-rl-orchestrator``.
        :param depends_on: on an imported cluster, what the charts wait for (nodes for the controllers, CoreDNS);
            default nothing. A ``MoeRlCluster`` gives its ``services_ready`` itself.
        """
        super().__init__(scope, id)
        if not isinstance(names, ClusterNamesConfig):
            raise TypeError(f"names: {names!r} is not allowed; a moe_rl_eks.core.environment.ClusterNamesConfig")
        unknown = sorted(set(pools) - {"trainer", "rollout"})
        if unknown:
            raise ValueError(f"pools: {unknown!r} is not allowed; the roles are trainer and rollout")
        if isinstance(cluster, MoeRlCluster):
            eks_cluster, self._ready = cluster.cluster, [*cluster.services_ready, *depends_on]
            self._service_account = cluster.service_account
        else:
            eks_cluster, self._ready = cluster, list(depends_on)
            require_kubectl_provider(eks_cluster, "ClusterServices")
            self._service_account = functools.partial(service_account, self, cluster=eks_cluster)
        version = _cluster_version(cluster, kubernetes_version)
        self.pins, self._pinned = KUBERNETES_PINS[version], pinned_charts(version)
        self.names = names
        self.device_plugins = DevicePlugins(self, "DevicePlugins", cluster=eks_cluster, pools=list(pools.values()),
                                            depends_on=self._ready)
        self.charts: dict[str, eks.HelmChart] = dict(self.device_plugins.charts)
        # Before the autoscaler and Kueue: both find the ProvisioningRequest API only if it is served when they start.
        provisioning_api = eks_cluster.add_manifest(
            "ProvisioningRequestApi", json.loads(PROVISIONING_REQUEST_CRD.read_text()), *_autoscaler_provisioning_rbac())
        self.autoscaler_role = self._cluster_autoscaler(eks_cluster)
        self.charts["cluster-autoscaler"].node.add_dependency(provisioning_api)
        keda = self._chart(eks_cluster, "keda", {"nodeSelector": _SYSTEM_NODES, "priorityClassName": _CRITICAL})
        if keda_role is not None:
            # The association must exist before the operator starts: Pod Identity injects credentials at pod start.
            association = eks.CfnPodIdentityAssociation(
                self, "KedaOperatorPodIdentity", cluster_name=eks_cluster.cluster_name,
                namespace=self.pins.keda.namespace, service_account=KEDA_OPERATOR_SERVICE_ACCOUNT,
                role_arn=keda_role.role_arn)
            keda.node.add_dependency(association)
        jobset = self._chart(eks_cluster, "jobset", {"controller": {"nodeSelector": _SYSTEM_NODES}})
        # The JobSet chart has no priorityClassName value: patch its controller's Deployment once the release is up
        # (Helm's three-way merge keeps a field the chart never sets across upgrades).
        priority = eks.KubernetesPatch(
            self, "JobSetControllerPriority", cluster=eks_cluster, resource_name=f"deployment/{JOBSET_CONTROLLER}",
            resource_namespace=CHARTS["jobset"].namespace,
            apply_patch={"spec": {"template": {"spec": {"priorityClassName": _CRITICAL}}}},
            restore_patch={"spec": {"template": {"spec": {"priorityClassName": None}}}})
        priority.node.add_dependency(jobset)
        kueue = self._chart(eks_cluster, "kueue", {
            "controllerManager": {"nodeSelector": _SYSTEM_NODES, "manager": {"priorityClassName": _CRITICAL}},
            # JSON is YAML: the chart writes this string into the manager's config map as it is.
            "managerConfig": {"controllerManagerConfigYaml": json.dumps(kueue_configuration())}})
        kueue.node.add_dependency(provisioning_api)
        self.gang_admission = eks_cluster.add_manifest("GangAdmissionCheck", *gang_admission_objects())
        self.gang_admission.node.add_dependency(kueue)
        self._priority_classes(eks_cluster)
        self.cluster_queues = {role: self._queues(eks_cluster, role, pool, run_namespace, namespace_manifest)
                               for role, pool in pools.items()}

    def _chart(self, cluster: eks.ICluster, name: str, values: dict) -> eks.HelmChart:
        chart = add_chart(self, cluster, self._pinned[name], values, self._ready)
        self.charts[name] = chart
        return chart

    def _cluster_autoscaler(self, cluster: eks.ICluster) -> iam.IRole:
        stack = Stack.of(self)
        account = self._service_account(
            "ClusterAutoscalerServiceAccount", name=CLUSTER_AUTOSCALER_SERVICE_ACCOUNT, namespace="kube-system")
        role = account.role
        # Describe calls take no resource; scaling is limited to this cluster's node groups by their EKS tag.
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
                     "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
                     "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
                     "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements"],
            resources=["*"]))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
            resources=["*"], conditions={"StringEquals": {"aws:ResourceTag/eks:cluster-name": cluster.cluster_name}}))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["eks:DescribeNodegroup"],
            resources=[stack.format_arn(service="eks", resource="nodegroup", resource_name=f"{cluster.cluster_name}/*")]))
        Validations.of(role).acknowledge(
            Acknowledgment(id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                           reason="Cluster Autoscaler's Describe* calls have no resource-level permissions; scaling "
                                  "actions are limited to this cluster's node groups by tag condition."),
            Acknowledgment(id=f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:{nag_partition(stack)}:eks:{stack.region}:"
                              f"{stack.account}:nodegroup/{_nag_cluster_name(cluster)}/*]",
                           reason="DescribeNodegroup on this cluster's node groups only (labels, taints and tags for "
                                  "scale from zero); their ids are generated by EKS."))
        chart = self._chart(cluster, "cluster-autoscaler", {
            "cloudProvider": "aws",
            "awsRegion": stack.region,
            "autoDiscovery": {"clusterName": cluster.cluster_name},
            "image": {"tag": self.pins.cluster_autoscaler_image_tag},
            "rbac": {"serviceAccount": {"create": False, "name": CLUSTER_AUTOSCALER_SERVICE_ACCOUNT}},
            "nodeSelector": _SYSTEM_NODES,
            "priorityClassName": _CRITICAL,
            "extraArgs": {"balance-similar-node-groups": True, "skip-nodes-with-system-pods": False,
                          "expander": "least-waste",
                          # ProvisioningRequests (gang admission) are read as JSON only (the autoscaler's FAQ).
                          "enable-provisioning-requests": True, "kube-api-content-type": "application/json"},
        })
        chart.node.add_dependency(*account.ready)
        return role

    def _priority_classes(self, cluster: eks.ICluster) -> None:
        cluster.add_manifest("PriorityClasses", *[{
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
            "value": value, "preemptionPolicy": policy, "globalDefault": False, "description": description,
        } for name, value, policy, description in (
            (self.names.trainer_priority_class, TRAINER_PRIORITY, "PreemptLowerPriority", "moe-rl trainer gangs"),
            (self.names.orchestrator_priority_class, ORCHESTRATOR_PRIORITY, "Never",
             "moe-rl orchestrators: above rollout servers, never preempts (shares nodes with controllers)"),
            (self.names.rollout_priority_class, ROLLOUT_PRIORITY, "Never", "moe-rl rollout servers: never preempt"),
        )])

    def _queues(self, cluster: eks.ICluster, role: str, pool: EfaNodePool, namespace: str,
                namespace_manifest: IDependable | None) -> eks.KubernetesManifest:
        manifest = cluster.add_manifest(f"{pascal(role)}Queues", *queue_objects(
            role, pool.pool, namespace, queue=self.names.queue(role)))
        manifest.node.add_dependency(self.charts["kueue"], self.gang_admission,
                                     *([namespace_manifest] if namespace_manifest is not None else []))
        return manifest


def _cluster_version(cluster: MoeRlCluster | eks.ICluster, kubernetes_version: str | None) -> str:
    """The Kubernetes minor the services are pinned for: a MoeRlCluster's own, else the one given."""
    if isinstance(cluster, MoeRlCluster):
        if kubernetes_version not in (None, cluster.kubernetes_version):
            raise ValueError(f"kubernetes_version: {kubernetes_version!r} is not allowed; the cluster runs "
                             f"{cluster.kubernetes_version} (leave it unset with a MoeRlCluster)")
        return cluster.kubernetes_version
    if kubernetes_version not in KUBERNETES_VERSIONS:
        raise ValueError(f"kubernetes_version: {kubernetes_version!r} is not allowed; the imported cluster's minor, "
                         "which picks KEDA's release and the autoscaler's image, "
                         f"{kubernetes_versions_allowed()}")
    return kubernetes_version


def _nag_cluster_name(cluster: eks.ICluster) -> str:
    """The cluster name as cdk-nag prints it in a resource: a created cluster's as ``<LogicalId>``, an imported
    one's as given."""
    resource = cluster.node.default_child
    return f"<{Stack.of(cluster).get_logical_id(resource)}>" if resource is not None else cluster.cluster_name


def _autoscaler_provisioning_rbac() -> list[dict]:
    """What the autoscaler's service account needs to serve ProvisioningRequests (its FAQ's ClusterRole)."""
    name = "cluster-autoscaler-provisioning"
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
         "rules": [{"apiGroups": ["autoscaling.x-k8s.io"],
                    "resources": ["provisioningrequests", "provisioningrequests/status"],
                    "verbs": ["watch", "list", "get", "create", "update", "patch", "delete"]},
                   {"apiGroups": [""], "resources": ["podtemplates"], "verbs": ["watch", "list", "get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": CLUSTER_AUTOSCALER_SERVICE_ACCOUNT,
                       "namespace": CHARTS["cluster-autoscaler"].namespace}]},
    ]


def gang_admission_objects() -> list[dict]:
    """The ProvisioningRequestConfig and the AdmissionCheck that gang ClusterQueues name (GANG_PROVISIONING)."""
    return [
        {"apiVersion": KUEUE_API, "kind": "ProvisioningRequestConfig", "metadata": {"name": GANG_PROVISIONING},
         "spec": {"provisioningClassName": PROVISIONING_CLASS,
                  # Only pods that need GPUs are provisioned for; a run's GPU pods all land in the gang's pool.
                  "managedResources": [GPU_RESOURCE],
                  # A failed or expired request is retried 60 s, 120 s, ... up to 30 min apart; after 8 tries (about
                  # 2 h) Kueue deactivates the workload, which `kubectl patch ... activate` resumes.
                  "retryStrategy": {"backoffLimitCount": 8, "backoffBaseSeconds": 60, "backoffMaxSeconds": 1800}}},
        {"apiVersion": KUEUE_API, "kind": "AdmissionCheck", "metadata": {"name": GANG_PROVISIONING},
         "spec": {"controllerName": PROVISIONING_CONTROLLER,
                  "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig",
                                 "name": GANG_PROVISIONING}}},
    ]


def queue_objects(role: str, pool: NodePoolConfig, namespace: str, *, queue: str | None = None) -> list[dict]:
    """The pool's Kueue ResourceFlavor, ClusterQueue and LocalQueue (in ``namespace``), both queues named ``queue``
    (default: ClusterNamesConfig's name for the role)."""
    queue = queue or ClusterNamesConfig().queue(role)
    spec, n = pool.spec, pool.max_size
    # Quota = the pool at max size: Kueue admits a gang only if all of it fits. Every resource a run's pods
    # request must be covered or Kueue refuses the workload.
    quota = {"cpu": spec.vcpus * n, "memory": f"{spec.memory_gib * n}Gi", GPU_RESOURCE: spec.gpus * n}
    if pool.efa and spec.efa_interfaces:
        quota[EFA_RESOURCE] = spec.efa_interfaces * n
    if pool.hugepages_2mi:
        quota[HUGEPAGES_RESOURCE] = f"{hugepages_mib(pool.hugepages_2mi) * n}Mi"
    flavor = f"moe-rl-{role}"
    # Every flavor of a gang queue (no onFlavors): nothing is admitted on quota alone.
    checks = {"admissionChecksStrategy": {"admissionChecks": [{"name": GANG_PROVISIONING}]}} if role in GANG_ROLES else {}
    return [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": flavor},
         "spec": {"nodeLabels": {ROLE_LABEL: role}, "tolerations": tolerations(pool.taints)}},
        {"apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": queue},
         "spec": {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO", **checks,
                  "resourceGroups": [{"coveredResources": list(quota), "flavors": [{
                      "name": flavor, "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}]}]}},
        {"apiVersion": KUEUE_API, "kind": "LocalQueue",
         "metadata": {"name": queue, "namespace": namespace},
         "spec": {"clusterQueue": queue}},
    ]
