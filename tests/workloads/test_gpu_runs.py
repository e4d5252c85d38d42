"""tools/gpu_runs/ep.sh (issue 17's runs on 4 and 8 H200s) and h200x2.sh (issue 30's on 2) cannot run here; what
can be checked is that they are valid shell, shellcheck-clean, refuse a GPU count or step they have no plan for,
and that every command, flag, test and file they call exists, so the first call on such a machine is not spent on a
typo."""
import functools
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


H200X2 = ROOT / "tools" / "gpu_runs" / "h200x2.sh"


@functools.cache
def _help_procs() -> dict[str, subprocess.Popen]:
    """`python -m MODULE --help` of every benchmark module the two scripts call, started at once (each imports
    torch: ~2.5 s, on both cores at a time) and read by help_text."""
    modules = {SUBCOMMANDS[sub][0] for sub in ("bench-ep", "bench-train", "bench-rollout")} | {
        "moe_rl_eks.tools.bench.rl_gpu"}
    return {m: subprocess.Popen([sys.executable, "-m", m, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for m in sorted(modules)}


@functools.cache
def help_text(module: str) -> str:
    """`python -m MODULE --help`'s output (exit 0 asserted): the same text for every test that asks."""
    proc = _help_procs().get(module) or subprocess.Popen([sys.executable, "-m", module, "--help"],
                                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{module} --help exited {proc.returncode}: {err}"
    return out


def commands(script: Path = SCRIPT) -> list[list[str]]:
    """The script's lines with continuations joined, as words."""
    text = script.read_text().replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


@pytest.mark.parametrize("script", [SCRIPT, H200X2], ids=lambda p: p.name)
def test_the_script_is_valid_bash_and_shellcheck_clean(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    result = subprocess.run([shellcheck, "-x", str(script)], capture_output=True, text=True, cwd=ROOT)
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
        text = help_text(SUBCOMMANDS[sub][0])
        for flag in (w for w in rest if w.startswith("--")):
            assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", text), f"{sub} has no {flag}"


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


def test_h200x2_refuses_a_step_it_has_no_plan_for_naming_what_is_allowed(tmp_path):
    result = subprocess.run(["bash", str(H200X2)], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "OUT": str(tmp_path), "STEPS": "rl-sync rl-colocated"})
    assert result.returncode == 2
    assert "STEPS: 'rl-colocated' is not one of: rl-sync rl-async rl-async-1 rl-async-2 deepep" in result.stderr
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_h200x2_calls_only_commands_flags_and_tests_that_exist():
    words = [w for line in commands(H200X2) for w in line]
    text = H200X2.read_text()
    # bench-rl --gpu hands the rest of its flags to tools/bench/rl_gpu.py
    for sub, module in (("bench-rl", "moe_rl_eks.tools.bench.rl_gpu"), ("bench-train", SUBCOMMANDS["bench-train"][0]),
                        ("bench-rollout", SUBCOMMANDS["bench-rollout"][0])):
        module_help = help_text(module)
        line = re.split(r";;|\n}", text[text.index(f"cli {sub}"):])[0]  # to the end of its case or function
        for flag in set(re.findall(r"\s(--[a-z][\w-]*)", line)) - {"--gpu"}:
            assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", module_help), f"{sub} has no {flag}"
    files = {w for w in words if w.startswith("tests/")} | set(re.findall(r"(tests/[\w/]+\.py)", text))
    assert files and all((ROOT / f.split("::")[0]).is_file() for f in files), files
    fsdp = re.search(r"FSDP=(\S+)", text).group(1).split("::")[1]
    assert f"def {fsdp}(" in (ROOT / "tests/rl/test_trainer_fsdp.py").read_text()
    assert re.findall(r'pytest.param\(2, "(\w+)", True', (ROOT / "tests/rl/test_trainer_fsdp.py").read_text()) == [
        "grpo", "ppo"]  # the ids [2-grpo-True] and [2-ppo-True] the script selects


BUDGET_SH = ROOT / "tools" / "gpu_runs" / "budget.sh"


def _budget_sh(command: str, cwd: Path, cache: Path, out: Path) -> str:
    result = subprocess.run(["bash", "-c", f"source {BUDGET_SH}; {command}"], cwd=cwd, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "TRITON_CACHE_DIR": str(cache), "OUT": str(out)})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_calls_kernel_cache_comes_back_and_a_later_call_that_carries_it_starts_from_it(tmp_path):
    # one call's compiled kernels (a Triton cache: folders of binaries and autotuning choices) saved under $OUT ...
    first, out = tmp_path / "first" / "triton", tmp_path / "out"
    (first / "ab12").mkdir(parents=True)
    (first / "ab12" / "_kernel.cubin").write_bytes(os.urandom(3000))
    (first / "ab12" / "_kernel.autotune.json").write_text('{"BLOCK_N": 16}')
    out.mkdir()
    said = _budget_sh("save_kernel_cache", tmp_path, first, out)
    assert "KiB in triton-cache.tgz" in said and (out / "triton-cache.tgz").is_file()
    # ... copied into the repository's carried folder, unpacked by the next call's package setup
    repo, second = tmp_path / "repo", tmp_path / "second" / "triton"
    (repo / ".kernel-cache").mkdir(parents=True)
    shutil.copy(out / "triton-cache.tgz", repo / ".kernel-cache" / "triton.tgz")
    assert "2 files from .kernel-cache/triton.tgz" in _budget_sh("restore_kernel_cache", repo, second, out)
    for name in ("_kernel.cubin", "_kernel.autotune.json"):
        assert (second / "ab12" / name).read_bytes() == (first / "ab12" / name).read_bytes()
    # without a carried cache the setup starts empty and says nothing
    assert _budget_sh("restore_kernel_cache", tmp_path, tmp_path / "third", out) == ""


def test_a_kernel_cache_over_what_a_returned_file_may_hold_is_not_returned(tmp_path):
    cache, out = tmp_path / "triton", tmp_path / "out"
    cache.mkdir()
    out.mkdir()
    (cache / "big.cubin").write_bytes(os.urandom(17 << 20))  # random bytes: compression keeps 17 MiB
    said = _budget_sh("save_kernel_cache", tmp_path, cache, out)
    assert "17 MiB compressed, over the 16 MiB" in said and not (out / "triton-cache.tgz").exists()
