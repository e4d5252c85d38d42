"""Images are pinned: a digest or a release tag, never a floating tag."""
import pytest

from moe_rl_eks.core.deploy import image_reference, image_version_problem

REPO = "111111111111.dkr.ecr.us-east-1.amazonaws.com/moe-rl-dev/trainer"
DIGEST = "sha256:" + "ab" * 32


def test_digest_and_tag_references():
    assert image_reference(REPO, DIGEST) == f"{REPO}@{DIGEST}"
    assert image_reference(REPO, "v0.1.0") == f"{REPO}:v0.1.0"


@pytest.mark.parametrize("version", [DIGEST, "v0.1.0", "2026-11-29.3", "git-1c08f25"])
def test_pinned_versions_are_accepted(version):
    assert image_version_problem(version) is None


@pytest.mark.parametrize("version, fragment", [
    ("latest", "floating tags"),
    ("Main", "floating tags"),
    ("sha256:" + "ab" * 31, "expected a digest"),
    ("v1:2", "expected a digest"),
    ("", "expected a digest"),
])
def test_floating_or_malformed_versions_are_refused(version, fragment):
    assert fragment in image_version_problem(version)
