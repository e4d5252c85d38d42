"""Artifacts: the S3 bucket for checkpoints, weights, prompts and rollout logs; FSx for Lustre linked to it in the GPU
zone; ECR repositories for the trainer and rollout images. Access is granted per prefix, with explicit actions."""
from __future__ import annotations

import re

from aws_cdk import (Acknowledgment, Duration, RemovalPolicy, Stack, Validations, aws_ec2 as ec2, aws_ecr as ecr,
                     aws_fsx as fsx, aws_iam as iam, aws_kms as kms, aws_s3 as s3)
from constructs import Construct

from moe_rl_eks.core.cluster import ROLLOUT_LOGS_PREFIX

# The bucket is linked at the file system's root (data repository association), so the file system mirrors the
# bucket's layout: /fsx/runs/<run>/ (checkpoints the trainer writes) is s3://<bucket>/runs/<run>/, and what is put
# under prompts/ or weights/ in the bucket appears under /fsx/prompts/ and /fsx/weights/.
FSX_LINK_PATH = "/"
_REPOSITORY_PREFIX = re.compile(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*")
LUSTRE_PORT_RANGES = ((988, 988), (1018, 1023))  # TCP


class MoeRlStorage(Construct):
    """Bucket, FSx for Lustre and image repositories.

    Attributes: ``bucket``, ``key`` (KMS key of the bucket and repositories), ``file_system`` (None when FSx is off),
    ``trainer_repository``, ``rollout_repository``, ``orchestrator_repository``. Methods: ``grant_read_prefix`` / ``grant_read_write_prefix``
    give a principal exactly Get/List (and Put/Delete) under a prefix, never a wildcard action.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        vpc: ec2.IVpc,
        fsx_subnet: ec2.ISubnet | None,
        fsx_client_security_group_id: str | None = None,
        fsx_storage_capacity_gib: int = 1200,
        fsx_throughput_mbps_per_tib: int = 250,
        noncurrent_version_expiry_days: int = 30,
        rollout_log_expiry_days: int = 90,
        retain_on_delete: bool = True,
        repository_prefix: str | None = None,
    ) -> None:
        """
        :param vpc: the VPC of the file system.
        :param fsx_subnet: the subnet (GPU zone) of the FSx for Lustre file system; None: no file system.
        :param fsx_client_security_group_id: security group of the Lustre clients (the cluster security group,
            which every node carries); default: the VPC CIDR may reach the Lustre ports.
        :param fsx_storage_capacity_gib: PERSISTENT_2 capacity, 1200 or a multiple of 2400; default 1200.
        :param fsx_throughput_mbps_per_tib: 125, 250 (default), 500 or 1000.
        :param noncurrent_version_expiry_days: old object versions are deleted after this; default 30.
        :param rollout_log_expiry_days: rollout logs are deleted after this; default 90.
        :param retain_on_delete: default True: bucket, key and repositories survive stack deletion.
        :param repository_prefix: name the image repositories ``<prefix>/trainer``, ``<prefix>/rollout`` and
            ``<prefix>/orchestrator`` (what `make images REGISTRY=<account registry>/<prefix>` pushes to); default:
            names CloudFormation generates.
        """
        super().__init__(scope, id)
        removal = RemovalPolicy.RETAIN if retain_on_delete else RemovalPolicy.DESTROY
        self.key = kms.Key(self, "Key", enable_key_rotation=True, removal_policy=removal,
                           description="moe-rl artifacts: bucket, file system, image repositories")
        access_logs = s3.Bucket(
            self, "AccessLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, versioned=True, removal_policy=removal,
            auto_delete_objects=False, object_ownership=s3.ObjectOwnership.BUCKET_OWNER_PREFERRED,
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(365),
                                              noncurrent_version_expiration=Duration.days(30))])
        Validations.of(access_logs).acknowledge(Acknowledgment(
            id="AwsSolutions::AwsSolutions-S1",
            reason="This is the access-log bucket itself; logging it to another bucket would only move the question."))
        self.bucket = s3.Bucket(
            self, "Bucket",
            encryption=s3.BucketEncryption.KMS, encryption_key=self.key, bucket_key_enabled=True,
            enforce_ssl=True, versioned=True, block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            server_access_logs_bucket=access_logs, server_access_logs_prefix="artifacts/",
            removal_policy=removal,
            lifecycle_rules=[
                s3.LifecycleRule(id="abort-incomplete-uploads", abort_incomplete_multipart_upload_after=Duration.days(7)),
                s3.LifecycleRule(id="expire-old-versions",
                                 noncurrent_version_expiration=Duration.days(noncurrent_version_expiry_days)),
                s3.LifecycleRule(id="expire-rollout-logs", prefix=ROLLOUT_LOGS_PREFIX,
                                 expiration=Duration.days(rollout_log_expiry_days)),
            ],
        )
        repo_props = dict(image_scan_on_push=True, image_tag_mutability=ecr.TagMutability.IMMUTABLE,
                          encryption=ecr.RepositoryEncryption.KMS, encryption_key=self.key, removal_policy=removal,
                          lifecycle_rules=[ecr.LifecycleRule(max_image_count=200)])
        if repository_prefix is not None and not _REPOSITORY_PREFIX.fullmatch(repository_prefix):
            raise ValueError(f"repository_prefix: {repository_prefix!r} is not allowed; lowercase letters, digits and "
                             "'-', '_', '.', '/' between them (an ECR repository namespace)")

        def repository(id: str, image: str) -> ecr.Repository:
            name = f"{repository_prefix}/{image}" if repository_prefix else None
            return ecr.Repository(self, id, repository_name=name, **repo_props)

        self.trainer_repository = repository("TrainerRepository", "trainer")
        self.rollout_repository = repository("RolloutRepository", "rollout")
        # The orchestrator's image is CPU-only and small: it runs on the system nodes.
        self.orchestrator_repository = repository("OrchestratorRepository", "orchestrator")

        self.file_system = None
        if fsx_subnet is not None:
            self.file_system = self._lustre(vpc, fsx_subnet, fsx_client_security_group_id, fsx_storage_capacity_gib,
                                            fsx_throughput_mbps_per_tib, removal)

    def _lustre(self, vpc, subnet, client_sg_id, capacity_gib, throughput, removal) -> fsx.LustreFileSystem:
        sg = ec2.SecurityGroup(self, "LustreSecurityGroup", vpc=vpc, allow_all_outbound=False,
                               description="FSx for Lustre: Lustre ports from the cluster nodes")
        client = (ec2.Peer.security_group_id(client_sg_id) if client_sg_id else ec2.Peer.ipv4(vpc.vpc_cidr_block))
        # LNet connections are opened from either end (servers call clients back on 988 and 1018-1023), so the
        # Lustre ports are open both ways between the file system and its clients.
        for i, (low, high) in enumerate(LUSTRE_PORT_RANGES):
            port = ec2.Port.tcp_range(low, high)
            sg.add_ingress_rule(client, port, "Lustre clients")
            sg.add_egress_rule(client, port, "Lustre servers to their clients")
            sg.add_ingress_rule(sg, port, "Lustre servers among themselves")
            sg.add_egress_rule(sg, port, "Lustre servers among themselves")
            if client_sg_id:
                # The clients' group is the cluster security group, made by EKS, not by this stack.
                ec2.CfnSecurityGroupIngress(
                    self, f"LustreToClients{i}", group_id=client_sg_id, ip_protocol="tcp", from_port=low, to_port=high,
                    source_security_group_id=sg.security_group_id, description="Lustre servers to their clients")
        file_system = fsx.LustreFileSystem(
            self, "FileSystem", vpc=vpc, vpc_subnet=subnet, security_group=sg, kms_key=self.key,
            storage_capacity_gib=capacity_gib, removal_policy=removal,
            lustre_configuration=fsx.LustreConfiguration(
                deployment_type=fsx.LustreDeploymentType.PERSISTENT_2,
                per_unit_storage_throughput=throughput,
                data_compression_type=fsx.LustreDataCompressionType.LZ4),
        )
        # PERSISTENT_2 links S3 through a data repository association (import_path is PERSISTENT_1 only); changes
        # flow both ways so checkpoints written on /fsx reach the bucket and weights put in the bucket appear.
        dra, sync_events = fsx.CfnDataRepositoryAssociation, ["NEW", "CHANGED", "DELETED"]
        dra(
            self, "BucketLink", file_system_id=file_system.file_system_id,
            file_system_path=FSX_LINK_PATH, data_repository_path=f"s3://{self.bucket.bucket_name}/",
            batch_import_meta_data_on_create=True,
            s3=dra.S3Property(auto_import_policy=dra.AutoImportPolicyProperty(events=sync_events),
                              auto_export_policy=dra.AutoExportPolicyProperty(events=sync_events)))
        # FSx reaches the bucket through its service-linked role; it needs the bucket key for that.
        stack = Stack.of(self)
        self.key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:Decrypt", "kms:GenerateDataKey"],
            principals=[iam.AccountRootPrincipal()],
            resources=["*"],
            conditions={"StringEquals": {"kms:ViaService": f"s3.{stack.region}.amazonaws.com"},
                        "ArnLike": {"aws:PrincipalArn": f"arn:{stack.partition}:iam::{stack.account}:role/aws-service-role/"
                                                        "s3.data-source.lustre.fsx.amazonaws.com/*"}}))
        return file_system

    def grant_read_prefix(self, grantee: iam.IGrantable, prefix: str) -> None:
        """Get objects under ``prefix`` and list that prefix; decrypt with the bucket key."""
        self._grant(grantee, prefix, ["s3:GetObject"], ["kms:Decrypt"])

    def grant_read_write_prefix(self, grantee: iam.IGrantable, prefix: str) -> None:
        """Get, put and delete objects under ``prefix``, list it; encrypt and decrypt with the bucket key."""
        self._grant(grantee, prefix, ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                    ["kms:Decrypt", "kms:GenerateDataKey"])

    def _grant(self, grantee: iam.IGrantable, prefix: str, object_actions: list[str], key_actions: list[str]) -> None:
        if not prefix.endswith("/") or prefix.startswith("/"):
            raise ValueError(f"prefix: {prefix!r} is not allowed; a key prefix like 'runs/' (no leading '/', ending in '/')")
        objects = self.bucket.arn_for_objects(f"{prefix}*")
        iam.Grant.add_to_principal(grantee=grantee, actions=object_actions, resource_arns=[objects])
        grantee.grant_principal.add_to_principal_policy(iam.PolicyStatement(
            actions=["s3:ListBucket"], resources=[self.bucket.bucket_arn],
            conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}}))
        iam.Grant.add_to_principal(grantee=grantee, actions=key_actions, resource_arns=[self.key.key_arn])
