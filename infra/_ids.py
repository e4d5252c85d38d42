"""Construct ids derived from Kubernetes-style names (ids are a contract: renaming one replaces a resource)."""


def pascal(name: str) -> str:
    """``aws-fsx-csi-driver`` -> ``AwsFsxCsiDriver``."""
    return "".join(part.capitalize() for part in name.replace("_", "-").split("-"))
