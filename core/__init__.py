"""Facts shared by infra/, k8s/ and workloads/: catalog, configuration schemas, metric names, labels.

Nothing here imports aws_cdk, cdk8s or torch (tests/test_light_imports.py checks it).
"""
