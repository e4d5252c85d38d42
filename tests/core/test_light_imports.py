"""The shared facts must load in a training image without the CDK and on a platform team's machine without torch."""
import subprocess
import sys

HEAVY = ("aws_cdk", "cdk8s", "cdk8s_plus_35", "constructs", "jsii", "torch", "triton", "cdk_nag")


def test_core_modules_import_no_heavy_libraries():
    code = (
        "import sys, pkgutil, importlib, moe_rl_eks.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('moe_rl_eks.core.' + m.name)\n"
        "import moe_rl_eks.infra, moe_rl_eks.k8s, moe_rl_eks.workloads, moe_rl_eks.kernels, moe_rl_eks.tools\n"
        "import moe_rl_eks.workloads.rl, moe_rl_eks.workloads.rollout, moe_rl_eks.workloads.trainer\n"
        "import moe_rl_eks.workloads.orchestrator, moe_rl_eks.tools.bench\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_moerl_help_lists_commands_without_loading_heavy_libraries():
    code = (
        "import sys, contextlib, io\n"
        "from moe_rl_eks.tools.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf): rc = main(['--help'])\n"
        f"assert rc == 0 and 'synth-summary' in buf.getvalue(), buf.getvalue()\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
