"""Facts shared by infra/, k8s/, kernels/, workloads/ and tools/: catalog, configuration schemas (runs, sampling),
metric names, labels, hardware facts, what a role's container runs.

Nothing here imports aws_cdk, cdk8s or torch (tests/test_light_imports.py checks it).
"""
