"""Observability: node-side GPU/EFA metrics from Container Insights (the CloudWatch observability add-on) with alarms
and a dashboard; workload metrics (core.metrics) scraped by an Amazon Managed Prometheus managed scraper, with alert
rules routed to SNS through AMP's alert manager. One SNS topic receives both."""
from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

from aws_cdk import (Duration, RemovalPolicy, Stack, aws_aps as aps, aws_cloudwatch as cw,
                     aws_cloudwatch_actions as cw_actions, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam,
                     aws_kms as kms, aws_sns as sns, aws_sns_subscriptions as subs)
from constructs import Construct

from moe_rl_eks.core import metrics
from moe_rl_eks.core.labels import RUN_LABEL

_CONTAINER_INSIGHTS = "ContainerInsights"


def alert_rules(*, stall_seconds: int, straggler_ratio: float, rollout_backlog: int) -> str:
    """The AMP rule group (Prometheus rules YAML); metric names come from core.metrics."""
    run = RUN_LABEL.split("/")[-1]
    rules = [
        ("TrainerStalled", f"time() - max by ({run}) ({metrics.TRAINER_LAST_STEP_TIMESTAMP.name}) > {stall_seconds}",
         "5m", "critical", f"No optimizer step for more than {stall_seconds} s"),
        ("TrainerStraggler", f"max by ({run}) ({metrics.STRAGGLER_RATIO.name}) > {straggler_ratio}",
         "10m", "warning", f"Slowest rank takes over {straggler_ratio}x the median time to reach the gradient all-reduce"),
        ("RolloutBacklog", f"max by ({run}) ({metrics.ROLLOUT_QUEUE_DEPTH.name}) > {rollout_backlog}",
         "15m", "warning", f"More than {rollout_backlog} rollout requests queued for 15 minutes"),
    ]
    lines = ["groups:", "  - name: moe-rl", "    rules:"]
    for name, expr, for_, severity, summary in rules:
        lines += [f"      - alert: {name}", f"        expr: {expr}", f"        for: {for_}",
                  "        labels:", f"          severity: {severity}",
                  "        annotations:", f"          summary: {json.dumps(summary)}"]
    return "\n".join(lines) + "\n"


def scrape_configuration(namespace: str) -> str:
    """Prometheus scrape config for the managed scraper: pods of the run namespace annotated
    ``prometheus.io/scrape: "true"`` (port from ``prometheus.io/port``), labelled with their run."""
    run = RUN_LABEL.split("/")[-1]
    run_meta = "__meta_kubernetes_pod_label_" + RUN_LABEL.replace("/", "_").replace("-", "_").replace(".", "_")
    return textwrap.dedent(f"""\
        global:
          scrape_interval: 30s
        scrape_configs:
          - job_name: moe-rl-pods
            kubernetes_sd_configs:
              - role: pod
                namespaces:
                  names: [{namespace}]
            relabel_configs:
              - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
                action: keep
                regex: "true"
              - source_labels: [__address__, __meta_kubernetes_pod_annotation_prometheus_io_port]
                action: replace
                regex: ([^:]+)(?::\\d+)?;(\\d+)
                replacement: $1:$2
                target_label: __address__
              - source_labels: [{run_meta}]
                target_label: {run}
              - source_labels: [__meta_kubernetes_pod_name]
                target_label: pod
        """)


class MoeRlObservability(Construct):
    """Alarms, dashboards and Prometheus for one cluster.

    Attributes: ``topic`` (SNS, KMS-encrypted), ``alarms``, ``dashboard``, ``workspace`` (AMP; None when off),
    ``scraper``, ``scraper_write_role``, ``rule_groups``.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        cluster_name: str,
        run_namespace: str,
        scraper_subnets: Sequence[ec2.ISubnet],
        alarm_email: str | None = None,
        prometheus: bool = True,
        gpu_temperature_celsius: float = 85,
        trainer_stall_seconds: int = 900,
        straggler_ratio: float = 1.5,
        rollout_backlog: int = 512,
    ) -> None:
        """
        :param cluster: the cluster (dimensions of Container Insights metrics, source of the scraper).
        :param cluster_name: its name (CloudWatch dimension ``ClusterName``).
        :param run_namespace: namespace whose pods are scraped.
        :param scraper_subnets: subnets of the managed scraper's interfaces; give it subnets of its own (as
            MoeRlNetwork does), so the run pods' NetworkPolicy can admit scrapes from exactly those CIDRs.
        :param alarm_email: subscribed to the alarm topic; default none (subscribe later).
        :param prometheus: default True: AMP workspace, scraper, rule group and alert manager.
        :param gpu_temperature_celsius: alarm above this GPU temperature (throttling starts near it); default 85.
        :param trainer_stall_seconds: alert when no optimizer step finished for this long; default 900.
        :param straggler_ratio: alert when the slowest rank's step is this much slower than the median; default 1.5.
        :param rollout_backlog: alert when more rollout requests stay queued for 15 minutes; default 512.
        """
        super().__init__(scope, id)
        stack = Stack.of(self)
        key = kms.Key(self, "Key", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
                      description="moe-rl alarm topic and Prometheus workspace")
        # Both publishers encrypt with the topic's key.
        for service in ("cloudwatch.amazonaws.com", "aps.amazonaws.com"):
            key.grant(iam.ServicePrincipal(service), "kms:Decrypt", "kms:GenerateDataKey*")
        self.topic = sns.Topic(self, "Alarms", master_key=key, enforce_ssl=True, display_name="moe-rl alarms")
        if alarm_email:
            self.topic.add_subscription(subs.EmailSubscription(alarm_email))

        self.alarms = self._node_alarms(cluster_name, gpu_temperature_celsius)
        self.dashboard = self._dashboard(cluster_name)

        self.workspace = self.scraper = self.scraper_write_role = None
        self.rule_groups = None
        if prometheus:
            self._prometheus(cluster, key, run_namespace, scraper_subnets,
                             alert_rules(stall_seconds=trainer_stall_seconds, straggler_ratio=straggler_ratio,
                                         rollout_backlog=rollout_backlog), stack)

    def grant_query_metrics(self, grantee: iam.IGrantable) -> None:
        """Let ``grantee`` run PromQL queries against the workspace (KEDA's rollout autoscaler does)."""
        if self.workspace is None:
            raise ValueError("grant_query_metrics: this stack has no Prometheus workspace (prometheus=False)")
        iam.Grant.add_to_principal(grantee=grantee, actions=["aps:QueryMetrics"],
                                   resource_arns=[self.workspace.attr_arn])

    def _metric(self, cluster_name: str, name: str, statistic: str) -> cw.Metric:
        return cw.Metric(namespace=_CONTAINER_INSIGHTS, metric_name=name, dimensions_map={"ClusterName": cluster_name},
                         statistic=statistic, period=Duration.minutes(5))

    def _node_alarms(self, cluster_name: str, gpu_temperature: float) -> dict[str, cw.Alarm]:
        specs = {
            "GpuTemperature": (self._metric(cluster_name, "node_gpu_temperature", "Maximum"), gpu_temperature,
                               f"A GPU is above {gpu_temperature} C: it throttles and slows the whole gang"),
            "EfaRxDropped": (self._metric(cluster_name, "node_efa_rx_dropped", "Sum"), 0,
                             "EFA devices drop received packets: collectives retransmit and stall"),
            "EfaUnresponsiveRemote": (self._metric(cluster_name, "node_efa_unresponsive_remote_events", "Sum"), 0,
                                      "An EFA peer stopped responding: a node or link is failing"),
        }
        alarms = {}
        for name, (metric, threshold, description) in specs.items():
            alarm = metric.create_alarm(
                self, name, threshold=threshold, evaluation_periods=3, datapoints_to_alarm=2,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING, alarm_description=description)
            alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
            alarms[name] = alarm
        return alarms

    def _dashboard(self, cluster_name: str) -> cw.Dashboard:
        def graph(title: str, *names: str, statistic: str = "Average") -> cw.GraphWidget:
            return cw.GraphWidget(title=title, width=12, left=[self._metric(cluster_name, n, statistic) for n in names])

        dashboard = cw.Dashboard(self, "Dashboard")
        dashboard.add_widgets(
            graph("GPU utilization (%)", "node_gpu_utilization", "node_gpu_memory_utilization"),
            graph("GPU temperature (C, max)", "node_gpu_temperature", statistic="Maximum"),
            graph("EFA bytes/s", "node_efa_rx_bytes", "node_efa_tx_bytes", "node_efa_rdma_read_bytes",
                  "node_efa_rdma_write_bytes", statistic="Sum"),
            graph("EFA errors", "node_efa_rx_dropped", "node_efa_unresponsive_remote_events", statistic="Sum"),
        )
        dashboard.add_widgets(cw.AlarmStatusWidget(title="Alarms", width=24, alarms=list(self.alarms.values())))
        return dashboard

    def _prometheus(self, cluster: eks.ICluster, key: kms.IKey, namespace: str, subnets: Sequence[ec2.ISubnet],
                    rules: str, stack: Stack) -> None:
        alertmanager = textwrap.dedent(f"""\
            alertmanager_config: |
              route:
                receiver: sns
                group_by: [alertname, run]
              receivers:
                - name: sns
                  sns_configs:
                    - topic_arn: {self.topic.topic_arn}
                      sigv4:
                        region: {stack.region}
            """)
        self.workspace = aps.CfnWorkspace(self, "Workspace", alias=f"{stack.stack_name}-moe-rl",
                                          kms_key_arn=key.key_arn, alert_manager_definition=alertmanager)
        self.topic.add_to_resource_policy(iam.PolicyStatement(
            actions=["sns:Publish", "sns:GetTopicAttributes"], resources=[self.topic.topic_arn],
            principals=[iam.ServicePrincipal("aps.amazonaws.com")],
            conditions={"ArnEquals": {"aws:SourceArn": self.workspace.attr_arn}}))
        self.rule_groups = aps.CfnRuleGroupsNamespace(self, "AlertRules", name="moe-rl",
                                                      workspace=self.workspace.attr_arn, data=rules)
        # The workspace is encrypted with a customer managed key, which AMP's scraper service-linked role cannot use:
        # the scraper writes through a role configuration (AMP's role pair for such workspaces), a source role
        # only scrapers of this account may assume, and a write role that only the source role may assume, with
        # remote write to this workspace and the key. AMP creates the scraper's EKS access entry (with its Kubernetes
        # permissions) itself: one made here would clash with it.
        scrapers = stack.format_arn(service="aps", resource="scraper", resource_name="*")
        source_role = iam.Role(self, "ScraperSourceRole", assumed_by=iam.ServicePrincipal(
            "scraper.aps.amazonaws.com").with_conditions({"StringEquals": {"aws:SourceAccount": stack.account},
                                                          "ArnLike": {"aws:SourceArn": scrapers}}),
                               description="AMP managed scraper: assumes the write role of a CMK workspace")
        # The scraper passes its own ARN as the external id (AWS's cross-account scraping pattern); the ARN exists
        # only once the scraper does, so both trusts name this account's scrapers rather than this one.
        self.scraper_write_role = iam.Role(
            self, "ScraperWriteRole", assumed_by=iam.PrincipalWithConditions(
                iam.ArnPrincipal(source_role.role_arn), {"StringLike": {"sts:ExternalId": scrapers}}),
            description="AMP managed scraper: remote write to the CMK workspace")
        iam.Grant.add_to_principal(grantee=self.scraper_write_role, actions=["aps:RemoteWrite"],
                                   resource_arns=[self.workspace.attr_arn])
        key.grant(self.scraper_write_role, "kms:Decrypt", "kms:GenerateDataKey")
        source_role.add_to_principal_policy(iam.PolicyStatement(actions=["sts:AssumeRole"],
                                                                resources=[self.scraper_write_role.role_arn]))
        self.scraper = aps.CfnScraper(
            self, "Scraper",
            source=aps.CfnScraper.SourceProperty(eks_configuration=aps.CfnScraper.EksConfigurationProperty(
                cluster_arn=cluster.cluster_arn, subnet_ids=[s.subnet_id for s in subnets],
                security_group_ids=[cluster.cluster_security_group_id])),
            destination=aps.CfnScraper.DestinationProperty(amp_configuration=aps.CfnScraper.AmpConfigurationProperty(
                workspace_arn=self.workspace.attr_arn)),
            scrape_configuration=aps.CfnScraper.ScrapeConfigurationProperty(
                configuration_blob=scrape_configuration(namespace)),
            role_configuration=aps.CfnScraper.RoleConfigurationProperty(
                source_role_arn=source_role.role_arn, target_role_arn=self.scraper_write_role.role_arn),
        )
