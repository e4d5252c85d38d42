"""The cluster validation chart: run before a training run, on the same trainer nodes with the same pod spec and
collective environment the trainer gets.

Two gang jobs through the trainer queue (Kueue runs them one after the other when the pool fits one):
- `<run>-nccl-check`: NCCL all-reduce and all-to-all bus bandwidth across all trainer ranks, and which network
  NCCL picked on each rank (fails when EFA was expected and NCCL fell back to sockets);
- `<run>-ep-bench`: `moerl bench-ep`, our expert-parallel dispatch/combine benchmark, with the run's EP backend.
Results are in each job's pod 0 log (`kubectl logs`). Like every pod of a run, each first runs `moerl doctor --role
trainer [--efa]` as an init container with the same devices (GPUs, EFA, hugepages, locked-memory limit), so a node
that cannot do the work stops the job at init with the reason.
"""
from __future__ import annotations

from pathlib import Path

import cdk8s
from constructs import Construct

from moe_rl_eks.core import labels
from moe_rl_eks.core.deploy import image_reference
from moe_rl_eks.core.run import ResolvedRun

from .kube import k8s
from .outputs import StackOutputs
from .pods import RUN_CONFIG_DIR, aws_env
from .run_chart import no_metadata_egress, role_labels, selector
from .trainer import GangJob, add_gang_job

CHECK_SCRIPT = Path(__file__).parent / "scripts" / "collectives_check.py"
ROLE = "validation"
# NCCL's INFO log names the network it selected ("NET/OFI Selected provider is efa" or "NET/Socket").
NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p.log"}


class ValidationChart(cdk8s.Chart):
    def __init__(self, scope: Construct, id: str, *, resolved: ResolvedRun, outputs: StackOutputs):
        env, run = resolved.environment, resolved.run
        assert env is not None and run.deploy is not None, "resolve_run checked this is a cluster run"
        super().__init__(scope, id, namespace=env.run_namespace, disable_resource_name_hashes=True)
        name = run.name
        config_map = f"{name}-validate"
        k8s.KubeConfigMap(self, "script", metadata=k8s.ObjectMeta(name=config_map),
                          data={CHECK_SCRIPT.name: CHECK_SCRIPT.read_text()})
        image = image_reference(outputs.trainer_repository_uri, run.deploy.images.trainer)
        pod_labels = role_labels(name, ROLE)
        for job, command, extra_env in (
            ("nccl-check", ["python", f"{RUN_CONFIG_DIR}/{CHECK_SCRIPT.name}"], NCCL_LOG_ENV),
            ("ep-bench", ["moerl", "bench-ep"], {}),
        ):
            add_gang_job(self, resolved, GangJob(
                name=f"{name}-{job}", image=image, command=command, pod_labels=pod_labels, config_map=config_map,
                max_restarts=0, shm_gib=run.deploy.trainer_shm_gib, extra_env={**aws_env(env.region), **extra_env}))
        # Only validation ranks talk to each other (the run chart's default deny covers the rest of the run).
        for policy, ingress in (("default-deny", []), ("peers", [k8s.NetworkPolicyIngressRule(from_=[
                k8s.NetworkPolicyPeer(pod_selector=k8s.LabelSelector(match_labels=selector(name, ROLE)))])])):
            k8s.KubeNetworkPolicy(self, f"netpol-{policy}",
                                  metadata=k8s.ObjectMeta(name=f"{name}-{ROLE}-{policy}",
                                                          labels={labels.RUN_LABEL: name}),
                                  spec=k8s.NetworkPolicySpec(
                                      pod_selector=k8s.LabelSelector(match_labels=selector(name, ROLE)),
                                      policy_types=["Ingress"], ingress=ingress))
        no_metadata_egress(self, name, ROLE)
