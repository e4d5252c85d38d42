"""How a process that spans several GPUs of a node is started: the one command line the manifests (k8s/) and
the local runs (tools/) both build."""
from __future__ import annotations


def launch(command: list[str], *, processes: int, torchrun: tuple[str, ...] = ("torchrun",)) -> list[str]:
    """`command` as one process, or under torchrun as `processes` ranks on this node (a rollout server that
    spans several GPUs runs one rank per GPU). `--no-python --` runs `command` as given, options and all."""
    if processes == 1:
        return command
    return [*torchrun, "--standalone", f"--nproc-per-node={processes}", "--no-python", "--", *command]
