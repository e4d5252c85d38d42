"""MoeRlStack: one environment (core.environment.EnvironmentConfig) composed from the constructs of this package."""
from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Environment, Fn, Stack, aws_iam as iam
from constructs import Construct

from moe_rl_eks.core import cluster as names
from moe_rl_eks.core.environment import EnvironmentConfig

from .cluster import MoeRlCluster
from .network import MoeRlNetwork
from .node_pool import EfaNodePool
from .observability import MoeRlObservability
from .run_access import RunAccess
from .services import ClusterServices
from .storage import MoeRlStorage


class MoeRlStack(Stack):
    """Everything one environment needs: network, cluster, GPU pools, cluster services, storage, observability.

    Attributes mirror the parts: ``network``, ``cluster``, ``pools`` (role -> EfaNodePool), ``storage``,
    ``run_access``, ``services``, ``observability``.
    """

    def __init__(self, scope: Construct, id: str, *, config: EnvironmentConfig, **kwargs: Any) -> None:
        """
        :param config: the environment (account, region, pools, ...); build one with
            :func:`~moe_rl_eks.core.environment.load_environments` or directly (validated either way).
        :param kwargs: other ``cdk.Stack`` props (``tags``, ``termination_protection``, ...); ``env`` comes from
            the config.
        """
        if not isinstance(config, EnvironmentConfig):
            raise TypeError(f"config: {config!r} is not allowed; a moe_rl_eks.core.environment.EnvironmentConfig")
        for prop in ("env", "description"):
            if prop in kwargs:
                raise ValueError(f"{prop}: {kwargs[prop]!r} is not allowed; MoeRlStack sets it from config "
                                 f"(account {config.account}, region {config.region})")
        super().__init__(scope, id, env=Environment(account=config.account, region=config.region),
                         description=f"moe-rl-eks {config.name or id}: EKS with EFA GPU pools", **kwargs)
        self._zones = list(config.availability_zones)
        self.config = config
        self.network = MoeRlNetwork(self, "Network", availability_zones=config.availability_zones, cidr=config.vpc_cidr)
        gpu_subnet = self.network.private_subnet(config.gpu_availability_zone)
        cluster_name = f"moe-rl-{config.name or id.lower()}"
        admin = iam.Role.from_role_arn(self, "AdminRole", config.admin_role_arn, mutable=False)
        self.cluster = MoeRlCluster(
            self, "Cluster", vpc=self.network.vpc, kubernetes_version=config.kubernetes_version,
            cluster_name=cluster_name, public_endpoint_cidrs=config.endpoint.public_cidrs,
            admin_role=admin, subnets=self.network.private_subnets)
        eks_cluster = self.cluster.cluster
        self.pools = {role: EfaNodePool(self, f"{role.capitalize()}Pool", cluster=self.cluster, subnet=gpu_subnet,
                                        role=role, pool=pool_config)
                      for role, pool_config in config.pools().items()}
        storage = config.storage
        self.storage = MoeRlStorage(
            self, "Storage", vpc=self.network.vpc, fsx_subnet=gpu_subnet if storage.fsx else None,
            fsx_client_security_group_id=self.cluster.cluster_security_group_id,
            fsx_storage_capacity_gib=storage.fsx_storage_capacity_gib,
            fsx_throughput_mbps_per_tib=storage.fsx_throughput_mbps_per_tib,
            noncurrent_version_expiry_days=storage.noncurrent_version_expiry_days,
            rollout_log_expiry_days=storage.rollout_log_expiry_days, retain_on_delete=storage.retain_on_delete,
            repository_prefix=cluster_name)
        self.run_access = RunAccess(self, "RunAccess", cluster=self.cluster, storage=self.storage,
                                    namespace=config.run_namespace, file_system=self.storage.file_system)
        self.observability = MoeRlObservability(
            self, "Observability", cluster=eks_cluster, cluster_name=cluster_name, run_namespace=config.run_namespace,
            scraper_subnets=self.network.scraper_subnets, alarm_email=config.observability.alarm_email,
            prometheus=config.observability.prometheus)
        keda_role = None
        if self.observability.workspace is not None:
            # The rollout autoscaler (a KEDA ScaledObject in each run) reads the queue depth from this workspace.
            keda_role = self.cluster.pod_identity_role("KedaOperatorRole")
            self.observability.grant_query_metrics(keda_role)
        self.services = ClusterServices(self, "Services", cluster=self.cluster, pools=self.pools,
                                        run_namespace=config.run_namespace,
                                        namespace_manifest=self.run_access.namespace_manifest, keda_role=keda_role,
                                        names=config.cluster_names)
        if self.run_access.fsx_prepare_job is not None:
            # Kueue's Job webhook (failurePolicy Fail, every namespace) is registered before its pod answers: a Job
            # created in between is refused, and the kubectl handler does not retry that.
            self.run_access.fsx_prepare_job.node.add_dependency(self.services.charts["kueue"])

        CfnOutput(self, names.OUTPUT_CLUSTER_NAME, value=eks_cluster.cluster_name)
        CfnOutput(self, names.OUTPUT_BUCKET_NAME, value=self.storage.bucket.bucket_name)
        CfnOutput(self, names.OUTPUT_TRAINER_REPOSITORY_URI, value=self.storage.trainer_repository.repository_uri)
        CfnOutput(self, names.OUTPUT_ROLLOUT_REPOSITORY_URI, value=self.storage.rollout_repository.repository_uri)
        CfnOutput(self, names.OUTPUT_ORCHESTRATOR_REPOSITORY_URI,
                  value=self.storage.orchestrator_repository.repository_uri)
        if self.observability.workspace is not None:
            CfnOutput(self, names.OUTPUT_PROMETHEUS_ENDPOINT,
                      value=self.observability.workspace.attr_prometheus_endpoint)
            CfnOutput(self, names.OUTPUT_SCRAPER_CIDRS,
                      value=Fn.join(",", [s.ipv4_cidr_block for s in self.network.scraper_subnets]))

    @property
    def availability_zones(self) -> list[str]:
        # The zones come from the environment, so synthesis never looks them up (no credentials needed).
        return self._zones
