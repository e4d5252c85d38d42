"""A platform team's view: the package built as a wheel, installed into a fresh environment apart from this
repository, and used by an app of their own (own VPC, own stacks, no cdk.json of ours) on a new and on an imported
cluster; it synthesizes with cdk-nag and the guardrails clean."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from infra_helpers import REPO, SYNTH_TIMEOUT_S, helm_charts, kubernetes_objects, offline_env, resources_of

# the module's wheel, fresh environment and synth are built once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("infra_own_app")

APP = Path(__file__).parent / "own_app" / "app.py"
SOURCES = ("core", "infra", "k8s", "workloads", "kernels", "tools", "pyproject.toml", "README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds, from a copy of the sources (the build writes next to them)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("moe_rl_eks-*.whl")
    return built


@pytest.fixture(scope="module")
def team_env(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """A fresh virtual environment holding only the wheel (its python, its site-packages); the dependencies
    (aws-cdk-lib, cdk-nag, ...) come from this interpreter's site-packages through a .pth (no network here), whose
    own .pth files, an editable install of this repository among them, are not processed."""
    env_dir = tmp_path_factory.mktemp("team") / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    with zipfile.ZipFile(wheel) as archive:  # a pure-Python wheel installs by unpacking it into site-packages
        archive.extractall(site)
    (site / "zz-shared-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python, site


def synthesize(python: Path, app_source: str, home: Path) -> tuple[str, dict[str, dict]]:
    """Run an app (its outdir is argv[1]) in ``home``, away from this repository; (stdout, templates by stack)."""
    home.mkdir()
    (home / "app.py").write_text(app_source)
    env = {k: v for k, v in offline_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "app.py", str(home / "cdk.out")], cwd=home, env=env, capture_output=True,
                          text=True, timeout=SYNTH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout, {p.name.removesuffix(".template.json"): json.loads(p.read_text())
                         for p in (home / "cdk.out").glob("*.template.json")}


@pytest.fixture(scope="module")
def own_app(team_env, tmp_path_factory) -> dict:
    python, site = team_env
    stdout, templates = synthesize(python, APP.read_text(), tmp_path_factory.mktemp("own") / "app")
    return {"site": site, "printed": json.loads(stdout.strip().splitlines()[-1]), "templates": templates}


def test_the_deploy_guides_example_synthesizes_nag_clean_in_the_fresh_environment(team_env, tmp_path):
    python, _ = team_env
    (example,) = re.findall(r"```python\n(import aws_cdk as cdk\n.*?)```", (REPO / "docs" / "deploy.md").read_text(), re.S)
    example = example.replace("app = cdk.App()", "import sys\napp = cdk.App(outdir=sys.argv[1])")
    _, templates = synthesize(python, example, tmp_path / "readme")
    assert set(templates) == {"Platform", "OnTheirCluster"}
    assert len(resources_of(templates["Platform"], "AWS::EKS::Nodegroup")) == 2  # system nodes and the p5 pool
    for template in templates.values():
        assert len(resources_of(template, "Custom::AWSCDK-EKS-HelmChart")) == 6  # plugins, Kueue, KEDA, JobSet, CA


def test_the_app_uses_the_installed_package_not_this_repository(own_app):
    assert Path(own_app["printed"]["moe_rl_eks.infra"]).is_relative_to(own_app["site"])
    assert set(own_app["templates"]) == {"TeamNewCluster", "TeamImportedCluster"}


def test_the_wheel_ships_the_grafana_dashboard_and_the_validation_script(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "moe_rl_eks/infra/dashboards/moe-rl.json" in names
    assert "moe_rl_eks/k8s/scripts/collectives_check.py" in names


def test_new_cluster_app_gets_a_capacity_block_pool_that_waits_for_the_vpc_cni(own_app):
    template = own_app["templates"]["TeamNewCluster"]
    (cni,) = [k for k, r in resources_of(template, "AWS::EKS::Addon").items() if r["Properties"]["AddonName"] == "vpc-cni"]
    (pool,) = [r for r in resources_of(template, "AWS::EKS::Nodegroup").values()
               if r["Properties"]["Labels"]["moe-rl/role"] == "trainer"]
    assert cni in pool["DependsOn"]
    props = pool["Properties"]
    assert props["CapacityType"] == "CAPACITY_BLOCK" and "InstanceTypes" not in props
    assert props["Taints"] == [{"Key": "nvidia.com/gpu", "Value": "true", "Effect": "NO_EXECUTE"}]
    assert props["Tags"]["k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"] == "true:NoExecute"
    assert props["Labels"]["team"] == "research"
    charts = {r["Properties"]["Release"] for r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").values()}
    assert charts == {"nvidia-device-plugin", "aws-efa-k8s-device-plugin"}


def test_imported_cluster_app_adds_an_efa_pool_and_the_cluster_services_through_their_provider(own_app):
    template = own_app["templates"]["TeamImportedCluster"]
    assert not resources_of(template, "AWS::EKS::Cluster") and not resources_of(template, "AWS::Lambda::Function")
    (pool,) = resources_of(template, "AWS::EKS::Nodegroup").values()
    assert pool["Properties"]["ClusterName"] == "their-cluster"
    assert pool["Properties"]["Subnets"] == ["subnet-0bbbbbbbbbbbbbbbb"]
    (lt,) = resources_of(template, "AWS::EC2::LaunchTemplate").values()
    interfaces = lt["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]
    assert len(interfaces) == 32 and all("sg-0123456789abcdef0" in i["Groups"] for i in interfaces)
    charts = resources_of(template, "Custom::AWSCDK-EKS-HelmChart").values()
    assert {c["Properties"]["ServiceToken"] for c in charts} == {
        "arn:aws:lambda:us-west-2:444444444444:function:their-kubectl"}
    assert {c["Properties"]["Release"] for c in charts} == {
        "nvidia-device-plugin", "aws-efa-k8s-device-plugin", "keda", "jobset", "kueue", "cluster-autoscaler"}
    # Pinned for the version they said their cluster runs (1.36): KEDA tested on it, the autoscaler of that minor.
    pinned = helm_charts(template)
    assert pinned["keda"]["Version"] == "2.21.0"
    assert pinned["cluster-autoscaler"]["Values"]["image"]["tag"] == "v1.36.1"
    # The autoscaler's identity: a Pod Identity association on their cluster, whose role only that cluster may use.
    (association,) = resources_of(template, "AWS::EKS::PodIdentityAssociation").values()
    assert (association["Properties"]["ClusterName"], association["Properties"]["ServiceAccount"]) == \
        ("their-cluster", "cluster-autoscaler")
    # The team's names, as the run manifests read them from the same setting (cluster_names).
    objects = kubernetes_objects(template)
    queues = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in ("ClusterQueue", "LocalQueue")}
    assert queues == {("ClusterQueue", "research-rollout"), ("LocalQueue", "research-rollout")}
    classes = {o["metadata"]["name"] for o in objects if o["kind"] == "PriorityClass"}
    assert classes == {"moe-rl-trainer", "moe-rl-orchestrator", "research-rollout"}
