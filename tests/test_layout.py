"""The layout is the architecture: each room imports only the rooms below it (lazy imports inside functions count
too), the three RL roles never import each other, and nothing but tests imports tools/."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# room -> the rooms it may import (besides itself). Rooms are top-level folders, or workloads/<part>.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "kernels": {"core.hardware"},
    "infra": {"core"},
    "k8s": {"core"},
    "workloads.model": {"core", "kernels", "workloads.moe"},
    "workloads.moe": {"core", "kernels"},
    "workloads.rl": {"core", "kernels", "workloads.model", "workloads.moe"},
    "workloads.rollout": {"core", "kernels", "workloads.model", "workloads.moe", "workloads.rl"},
    "workloads.trainer": {"core", "kernels", "workloads.model", "workloads.moe", "workloads.rl"},
    "workloads.orchestrator": {"core", "workloads.rl"},
    "tools": {"core", "infra", "k8s", "kernels", "workloads.model", "workloads.moe", "workloads.rl",
              "workloads.rollout", "workloads.trainer", "workloads.orchestrator"},
}
PACKAGE = "moe_rl_eks"


def room_of(module: str) -> str:
    """The room a dotted module path (without the package prefix) belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "workloads" and len(parts) > 1 else parts[0]


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every moe_rl_eks module `path` (under `root`) imports, absolute or relative, at the top or inside a
    function."""
    rel = path.relative_to(root).with_suffix("").parts
    package = list(rel[:-1])  # a module's package, and an __init__'s own
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name[len(PACKAGE) + 1:] for a in node.names if a.name.startswith(PACKAGE + ".")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{target}.{a.name}" for a in node.names} if node.module is None else {target}
            elif node.module and node.module.startswith(PACKAGE + "."):
                found.add(node.module[len(PACKAGE) + 1:])
    return found


def allowed(source_room: str, target: str) -> bool:
    target_room = room_of(target)
    if target_room == source_room:
        return True
    return any(target == a or target.startswith(a + ".") or target_room == a for a in ALLOWED[source_room])


def sources():
    for room in ("core", "kernels", "infra", "k8s", "workloads", "tools"):
        yield from sorted((ROOT / room).rglob("*.py"))


def test_every_room_imports_only_the_rooms_below_it():
    wrong = []
    for path in sources():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module == "workloads.__init__":
            continue  # the package face of the rooms below it: imports nothing
        room = room_of(module)
        if room not in ALLOWED:
            wrong.append(f"{path.relative_to(ROOT)}: in no known room ({room})")
            continue
        wrong += [f"{path.relative_to(ROOT)} imports {t}" for t in sorted(imports_of(path)) if not allowed(room, t)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("role", ["rollout", "trainer", "orchestrator"])
def test_no_rl_role_imports_another_role(role):
    others = {f"workloads.{r}" for r in ("rollout", "trainer", "orchestrator")} - {f"workloads.{role}"}
    wrong = [f"{p.relative_to(ROOT)} imports {t}" for p in sorted((ROOT / "workloads" / role).rglob("*.py"))
             for t in imports_of(p) if room_of(t) in others]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    """A rule that cannot fail proves nothing: a role module importing another role lazily is caught."""
    fake = tmp_path / "workloads" / "trainer" / "_layout_probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..rollout import engine\n    from moe_rl_eks.tools import cli\n")
    assert imports_of(fake, root=tmp_path) == {"workloads.rollout", "tools"}
    assert not allowed("workloads.trainer", "workloads.rollout")
    assert not allowed("workloads.trainer", "tools")


def test_every_subcommand_names_a_module_of_a_room_the_cli_may_import():
    from moe_rl_eks.tools.cli import SUBCOMMANDS

    for name, (module, _, _) in SUBCOMMANDS.items():
        target = module[len(PACKAGE) + 1:]
        assert allowed("tools", target), f"moerl {name}: {module}"
        assert (ROOT / (target.replace(".", "/") + ".py")).is_file(), f"moerl {name}: no file for {module}"
