"""The typed Kubernetes API every chart here builds its objects with (cdk8s-plus's L1 structs), chosen once for
every accepted Kubernetes version.

It is the oldest accepted version's (core.cluster.KUBERNETES_VERSIONS[0], a test holds the two together): a field
it types is served by every newer accepted version too, as Kubernetes removes a field from an API only with a new
API version. The objects do not depend on the cdk8s-plus release beyond that typing, and the tests validate every
run object strictly at every accepted version."""
from cdk8s_plus_35 import k8s

__all__ = ["k8s"]
