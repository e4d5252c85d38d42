"""tools/gpu_runs/ep.sh (issue 17's runs on 4 and 8 H200s) cannot run here; what can be checked is that it is
valid shell, shellcheck-clean, refuses a GPU count it has no plan for, and that every command, flag, test and file
it calls exists, so the first call on such a machine is not spent on a typo."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl_eks.tools.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_runs" / "ep.sh"


def commands() -> list[list[str]]:
    """The script's lines with continuations joined, as words."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def test_the_script_is_valid_bash_and_shellcheck_clean():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, "-x", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("gpus", ["", "2", "16"])
def test_a_gpu_count_without_a_plan_is_refused_naming_what_is_allowed(gpus, tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), gpus], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 2
    assert f"GPU count '{gpus}'; allowed: 4 (nvidia-h200-x4), 8 (nvidia-h200-x8)" in result.stderr
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_every_moerl_command_and_flag_the_script_calls_exists():
    called = [words[words.index("moe_rl_eks.tools.cli") + 1:] for words in commands() if "moe_rl_eks.tools.cli" in words]
    assert {c[0] for c in called} == {"bench-ep", "bench-train", "bench-rollout"}
    for sub, *rest in called:
        module = SUBCOMMANDS[sub][0]
        help_text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                                   check=True).stdout
        for flag in (w for w in rest if w.startswith("--")):
            assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", help_text), f"{sub} has no {flag}"


def test_the_tests_files_and_steps_the_script_names_exist():
    text = SCRIPT.read_text()
    [pytest_line] = [w for w in commands() if "pytest" in w]
    selector = pytest_line[pytest_line.index("-k") + 1]
    test_files = [w for w in pytest_line if w.startswith("tests/")]
    assert test_files and all((ROOT / f).is_file() for f in test_files)
    selected = [n for f in test_files for n in re.findall(r"^def (test_\w+)", (ROOT / f).read_text(), re.M)
                if selector in n]
    assert len(selected) >= 2  # the deepep and the alltoall-only one-rank-per-GPU tests
    assert (ROOT / "images/scripts/build_deepep.sh").is_file()
    assert re.search(r"^DEEPEP_COMMIT=[0-9a-f]{40}$", (ROOT / "images/versions.env").read_text(), re.M)
    # Every step STEPS may name is a step the script runs.
    default = re.search(r"steps=\$\{STEPS:-([^}]*)\}", text).group(1).split()
    assert default == re.findall(r"^\s*step ([\w-]+) \d+ ", text, re.M)
