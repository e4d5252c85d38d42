"""Every test directory's: make test's workers (pytest-xdist, --dist loadgroup) under pytest 9."""
import pytest
from _pytest.nodeid import coerce_node_id


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # xdist 3.8 sends an xdist_group's tests to one worker by their ids' "@group" suffix, which it writes into
    # item._nodeid; pytest 9 reads a node's id from item._id, so without this every group is spread over the
    # workers (its shared fixtures built on each, its timing-sensitive runs side by side)
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
