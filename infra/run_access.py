"""The namespace runs live in: its three service accounts bound by Pod Identity to least-privilege roles, and the
FSx for Lustre PersistentVolume/Claim trainers mount, with the runs directory prepared for the pods' UID. A run's
manifests (k8s/) only refer to these by name."""
from __future__ import annotations

import hashlib

from aws_cdk import Acknowledgment, Stack, Validations, aws_eks_v2 as eks, aws_fsx as fsx, aws_iam as iam
from constructs import Construct

from .cluster import MoeRlCluster

from moe_rl_eks.core import cluster as names
from moe_rl_eks.core.labels import PART_OF, PART_OF_LABEL
from moe_rl_eks.core.cluster import PROMPTS_PREFIX, ROLLOUT_LOGS_PREFIX, RUNS_PREFIX, WEIGHTS_PREFIX

from .storage import MoeRlStorage
METRICS_NAMESPACE = "MoeRl"  # CloudWatch namespace the trainer may put metrics into


class RunAccess(Construct):
    """Namespace, service accounts and shared volume for runs.

    Attributes: ``namespace_manifest``, ``roles`` (``trainer``, ``orchestrator``, ``rollout`` -> the IAM role of
    that service account), ``fsx_prepare_job`` (None without a file system).
    """

    def __init__(self, scope: Construct, id: str, *, cluster: MoeRlCluster, storage: MoeRlStorage,
                 namespace: str = "moe-rl", file_system: fsx.LustreFileSystem | None = None) -> None:
        """
        :param cluster: the cluster; its service accounts get Pod Identity roles only it may assume.
        :param storage: the artifact bucket the roles are scoped to.
        :param namespace: the run namespace; default ``moe-rl``.
        :param file_system: FSx for Lustre to expose as the ``moe-rl-fsx`` claim; default none.
        """
        super().__init__(scope, id)
        labels = {PART_OF_LABEL: PART_OF}
        self.namespace_manifest = cluster.cluster.add_manifest("RunNamespace", {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {**labels, **POD_SECURITY_LABELS}}})
        self.roles: dict[str, iam.Role] = {
            role: cluster.service_account(f"{role.capitalize()}ServiceAccount", name=sa_name, namespace=namespace,
                                          labels=labels, depends_on=[self.namespace_manifest]).role
            for role, sa_name in (("trainer", names.TRAINER_SERVICE_ACCOUNT),
                                  ("orchestrator", names.ORCHESTRATOR_SERVICE_ACCOUNT),
                                  ("rollout", names.ROLLOUT_SERVICE_ACCOUNT))}

        storage.grant_read_write_prefix(self.roles["trainer"], RUNS_PREFIX)
        storage.grant_read_write_prefix(self.roles["trainer"], WEIGHTS_PREFIX)
        self.roles["trainer"].add_to_principal_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricData"], resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": METRICS_NAMESPACE}}))
        storage.grant_read_prefix(self.roles["orchestrator"], PROMPTS_PREFIX)
        storage.grant_read_write_prefix(self.roles["orchestrator"], ROLLOUT_LOGS_PREFIX)
        storage.grant_read_prefix(self.roles["rollout"], WEIGHTS_PREFIX)
        self._acknowledge_prefix_wildcards(storage)

        self.fsx_prepare_job = None
        if file_system is not None:
            self.fsx_prepare_job = self._fsx_volume(cluster.cluster, namespace, file_system)

    def _acknowledge_prefix_wildcards(self, storage: MoeRlStorage) -> None:
        # cdk-nag names a finding by the statement's resource as written in the template.
        bucket_arn = f"<{Stack.of(self).get_logical_id(storage.bucket.node.default_child)}.Arn>"
        for role, prefixes in (("trainer", [RUNS_PREFIX, WEIGHTS_PREFIX]), ("orchestrator", [PROMPTS_PREFIX, ROLLOUT_LOGS_PREFIX]),
                               ("rollout", [WEIGHTS_PREFIX])):
            for prefix in prefixes:
                Validations.of(self.roles[role]).acknowledge(Acknowledgment(
                    id=f"AwsSolutions::AwsSolutions-IAM5[Resource::{bucket_arn}/{prefix}*]",
                    reason=f"Objects under the {prefix} prefix the {role} owns or reads; object keys are only known at run time."))
        Validations.of(self.roles["trainer"]).acknowledge(Acknowledgment(
            id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
            reason="cloudwatch:PutMetricData has no resource type; the statement is limited to one metric "
                   "namespace by condition."))

    def _fsx_volume(self, cluster: eks.ICluster, namespace: str,
                    file_system: fsx.LustreFileSystem) -> eks.KubernetesManifest:
        pv_name = f"{names.FSX_CLAIM_NAME}-{namespace}"
        capacity = f"{file_system.node.default_child.storage_capacity}Gi"
        manifest = cluster.add_manifest("FsxVolume", {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
            "spec": {"capacity": {"storage": capacity}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     # Lustre clients refuse flock() (ENOSYS) unless mounted with it; the fs weight store commits
                     # LATEST under an flock, coherent across the nodes that share the file system.
                     "mountOptions": ["flock"],
                     "claimRef": {"namespace": namespace, "name": names.FSX_CLAIM_NAME},
                     "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": file_system.file_system_id,
                             "volumeAttributes": {"dnsname": file_system.dns_name,
                                                  "mountname": file_system.mount_name}}},
        }, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": names.FSX_CLAIM_NAME, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv_name,
                     "resources": {"requests": {"storage": capacity}}},
        })
        manifest.node.add_dependency(self.namespace_manifest)
        # A new Lustre file system's root belongs to root, and fsGroup does not apply to a CSI volume without
        # fsGroupPolicy: a one-off Job makes the runs directory the pods' own (UID/GID 10001, setgid so what they
        # create keeps the group). It alone runs as root, with no capability but CHOWN, FOWNER and FSETID.
        prepare = cluster.add_manifest("FsxPrepareRuns", fsx_prepare_job(namespace))
        prepare.node.add_dependency(manifest)
        return prepare


# Pod Security admission for the run namespace: run pods meet `restricted` (non-root, no capabilities, RuntimeDefault
# seccomp); `baseline` is enforced because the one-off FSx Job below runs as root.
POD_SECURITY_LABELS = {"pod-security.kubernetes.io/enforce": "baseline",
                       "pod-security.kubernetes.io/warn": "restricted",
                       "pod-security.kubernetes.io/audit": "restricted"}
# A small pinned image from ECR Public (reachable through the NAT gateway); the Job only runs mkdir/chown/chmod.
FSX_PREPARE_IMAGE = "public.ecr.aws/docker/library/busybox:1.37.0"


def fsx_prepare_job(namespace: str) -> dict:
    """The Job that creates core.cluster.RUNS_DIR on the FSx claim, owned by the pods' UID and GID."""
    uid, runs = names.POD_UID, names.RUNS_DIR
    # chmod before chown: the setgid bit survives chown on a directory; FSETID keeps it when the Job runs again.
    script = f"set -eu; mkdir -p {runs}; chmod 2775 {runs}; chown {uid}:{uid} {runs}; ls -ldn {runs}"
    # A Job's pod template is immutable: a changed one is a new Job (its name carries the content), and a finished
    # Job removes itself after a day.
    digest = hashlib.sha256(f"{FSX_PREPARE_IMAGE}\n{script}".encode()).hexdigest()[:10]
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"moe-rl-fsx-prepare-{digest}", "namespace": namespace,
                     "labels": {PART_OF_LABEL: PART_OF}},
        "spec": {"backoffLimit": 6, "ttlSecondsAfterFinished": 86400, "template": {"metadata": {"labels": {PART_OF_LABEL: PART_OF}}, "spec": {
            "restartPolicy": "OnFailure", "automountServiceAccountToken": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "prepare", "image": FSX_PREPARE_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", script],
                "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"cpu": "200m", "memory": "64Mi"}},
                "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", "FSETID"]}},
                "volumeMounts": [{"name": "fsx", "mountPath": names.FSX_MOUNT_PATH}]}],
            "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": names.FSX_CLAIM_NAME}}]}}},
    }

