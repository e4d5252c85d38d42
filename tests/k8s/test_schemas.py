"""Every object validates: core kinds with kubernetes-validate --strict at every accepted Kubernetes version (a
run's objects do not depend on the cluster's version), custom resources against their CRD's openAPIV3Schema
(committed under data/crd_schemas, source in each file's $comment), with unknown fields refused as the API server's
strict field validation would."""
from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
from manifest_helpers import DATA, ROOT

from moe_rl_eks.core.cluster import DEFAULT_KUBERNETES_VERSION, KUBERNETES_VERSIONS
from moe_rl_eks.core.environment import load_cdk_json

CRD_SCHEMAS = {  # (apiVersion, kind) -> schema file
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_v1alpha2_JobSet.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_ScaledObject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_v1alpha1_TriggerAuthentication.json",
    # Applied by the infra stack (infra.services.queue_objects), validated here with the run's objects' schemas.
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): "kueue.x-k8s.io_v1beta2_ResourceFlavor.json",
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): "kueue.x-k8s.io_v1beta2_ClusterQueue.json",
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): "kueue.x-k8s.io_v1beta2_LocalQueue.json",
    ("kueue.x-k8s.io/v1beta2", "AdmissionCheck"): "kueue.x-k8s.io_v1beta2_AdmissionCheck.json",
    ("kueue.x-k8s.io/v1beta2", "ProvisioningRequestConfig"): "kueue.x-k8s.io_v1beta2_ProvisioningRequestConfig.json",
}
# The chart behind each CRD group, and, where a pinned release's own CRD files were not reachable, the release
# whose schemas stand in for them and why that is sound. Never for the default Kubernetes version's pins.
CRD_CHARTS = {"jobset.x-k8s.io": "jobset", "keda.sh": "keda", "kueue.x-k8s.io": "kueue"}
SCHEMA_STAND_INS = {("keda", "2.21.0"): (
    "2.20.2", "kedacore/keda main at 8b4f083 (2026-08-20, the 2.21 development tree) has v2.20.2's ScaledObject and "
              "TriggerAuthentication schemas")}


def strict(schema: dict) -> dict:
    """A structural schema prunes unknown fields; refuse them instead (a typo must fail here, not vanish)."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if node.get("pattern", "").startswith("^(?i)"):  # Go's RE2 takes a flag anywhere, Python only first
                node["pattern"] = "(?i)^" + node["pattern"][len("^(?i)"):]
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
    visit(schema)
    return schema


_VALIDATORS: dict = {}


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    key = (api_version, kind)
    if key not in _VALIDATORS:
        schema = json.loads((DATA / "crd_schemas" / CRD_SCHEMAS[key]).read_text())
        _VALIDATORS[key] = jsonschema.Draft7Validator(strict(schema))
    return _VALIDATORS[key]


def crd_errors(obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)]


def is_core(obj: dict) -> bool:
    return (obj["apiVersion"], obj["kind"]) not in CRD_SCHEMAS


def test_kubernetes_validate_ships_every_cluster_version_we_support():
    for version in KUBERNETES_VERSIONS:
        assert kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}},
                                            version, strict=True) == version


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_core_object_passes_strict_validation(objects, version):
    core = [o for o in objects if is_core(o)]
    kinds = {o["kind"] for o in core}
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    for obj in core:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_jobset_job_templates_pass_strict_validation_as_jobs(objects, version):
    """The CRD schema embeds the Job schema of JobSet's own Kubernetes version; check ours too."""
    jobsets = [o for o in objects if o["kind"] == "JobSet"]
    assert len(jobsets) == 6  # per run: trainer, nccl-check, ep-bench
    for jobset in jobsets:
        for rjob in jobset["spec"]["replicatedJobs"]:
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rjob["name"]},
                   "spec": rjob["template"]["spec"]}
            kubernetes_validate.validate(job, version, strict=True)


def test_every_custom_resource_matches_its_crd_schema(objects):
    custom = [o for o in objects if not is_core(o)]
    assert {o["kind"] for o in custom} == {"JobSet", "ScaledObject", "TriggerAuthentication"}
    for obj in custom:
        assert crd_errors(obj) == [], obj["metadata"]["name"]


@pytest.mark.parametrize("path, value, fragment", [
    (("spec", "failurePolicy", "maxRestart"), 3, "'maxRestart' was unexpected"),
    (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0, "resource"), {},
     "'resource' was unexpected"),
    (("spec", "successPolicy", "operator"), "Most", "'Most' is not one of"),
])
def test_crd_validation_catches_typos_and_bad_values(objects, path, value, fragment):
    jobset = copy.deepcopy(next(o for o in objects if o["kind"] == "JobSet"))
    node = jobset
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(fragment in e for e in crd_errors(jobset)), crd_errors(jobset)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_strict_core_validation_catches_a_misspelled_field(objects, version):
    deployment = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(deployment, version, strict=True)


def test_crd_schema_files_name_their_source():
    for name in CRD_SCHEMAS.values():
        comment = json.loads((DATA / "crd_schemas" / name).read_text())["$comment"]
        assert comment.startswith("openAPIV3Schema of ") and "github.com/" in comment


def test_crd_schemas_are_from_the_versions_the_infra_stack_installs():
    from moe_rl_eks.infra.services import pinned_charts  # loads aws_cdk (~2 s); the pin is what matters

    for version in KUBERNETES_VERSIONS:
        charts = pinned_charts(version)
        for (api_version, kind), name in CRD_SCHEMAS.items():
            chart = charts[CRD_CHARTS[api_version.split("/")[0]]]
            schema_release, _ = SCHEMA_STAND_INS.get((chart.chart, chart.version), (chart.version, ""))
            comment = json.loads((DATA / "crd_schemas" / name).read_text())["$comment"]
            assert f" v{schema_release.lstrip('v')} (" in comment, (version, kind, chart.version, comment)
    default = pinned_charts(DEFAULT_KUBERNETES_VERSION)
    assert not {(c.chart, c.version) for c in default.values()} & set(SCHEMA_STAND_INS)


def test_the_charts_typed_api_is_the_oldest_accepted_kubernetes_versions():
    from moe_rl_eks.k8s.kube import k8s

    oldest = min(KUBERNETES_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    assert k8s.__name__ == f"cdk8s_plus_{oldest.split('.')[1]}.k8s"


def test_the_kueue_objects_the_stack_applies_match_kueues_v1beta2_schemas():
    from moe_rl_eks.infra.services import queue_objects  # loads aws_cdk (~2 s)

    for env in load_cdk_json(ROOT / "cdk.json").values():
        for role, pool in env.pools().items():
            objects = queue_objects(role, pool, env.run_namespace)
            assert [o["kind"] for o in objects] == ["ResourceFlavor", "ClusterQueue", "LocalQueue"]
            for obj in objects:
                assert crd_errors(obj) == [], (env.name, role, obj["kind"])
    flavor = queue_objects("trainer", load_cdk_json(ROOT / "cdk.json")["dev"].trainer_pool, "moe-rl")[0]
    flavor["spec"]["toleration"] = flavor["spec"].pop("tolerations")
    assert any("'toleration' was unexpected" in e for e in crd_errors(flavor))


def test_the_gang_admission_check_and_its_provisioning_config_match_kueues_v1beta2_schemas():
    from moe_rl_eks.infra.services import gang_admission_objects  # loads aws_cdk (~2 s)

    config, check = gang_admission_objects()
    assert (config["kind"], check["kind"]) == ("ProvisioningRequestConfig", "AdmissionCheck")
    assert crd_errors(config) == [] and crd_errors(check) == []
    config["spec"]["podSetMergePolicy"] = "Identical"
    assert any("'Identical' is not one of" in e for e in crd_errors(config))
