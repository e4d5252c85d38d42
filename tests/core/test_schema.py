import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from moe_rl_eks.core.schema import ConfigError, fail, parse


@dataclass(frozen=True)
class Inner:
    size: int = 1

    def validate(self):
        if self.size > 10:
            fail("size", self.size, "must be <= 10")


@dataclass(frozen=True)
class Outer:
    name: str
    mode: Literal["a", "b"] = "a"
    ratio: float = 0.5
    tags: tuple[str, ...] = ()
    inner: Inner = field(default_factory=Inner)
    maybe: int | None = None


def test_parse_builds_nested_typed_objects():
    obj = parse(Outer, {"name": "x", "mode": "b", "ratio": 1, "tags": ["p", "q"], "inner": {"size": 3}}, source="f.yaml")
    assert obj == Outer("x", "b", 1.0, ("p", "q"), Inner(3), None)
    assert isinstance(obj.ratio, float)


@pytest.mark.parametrize("data, field_path, fragment", [
    ({}, "name", "required field missing"),
    ({"name": "x", "mode": "c"}, "mode", "allowed: 'a', 'b'"),
    ({"name": "x", "colour": 1}, "colour", "unknown field; known fields: inner, maybe, mode, name, ratio, tags"),
    ({"name": "x", "inner": {"size": 11}}, "inner.size", "must be <= 10"),
    ({"name": "x", "inner": {"size": True}}, "inner.size", "expected an integer"),
    ({"name": 3}, "name", "expected a string"),
    ({"name": "x", "tags": "p"}, "tags", "expected a list"),
    ({"name": "x", "maybe": "1"}, "maybe", "expected an integer"),
])
def test_bad_values_name_source_field_value_and_what_is_allowed(data, field_path, fragment):
    with pytest.raises(ConfigError) as err:
        parse(Outer, data, source="f.yaml")
    assert err.value.field == field_path
    assert str(err.value).startswith(f"f.yaml: {field_path}: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[2] / "configs" / "runs").glob("*.yaml")))
def test_dump_is_the_inverse_of_parse_for_every_example_run(name):
    from moe_rl_eks.core.run import RunConfig, load_run
    from moe_rl_eks.core.schema import dump

    run = load_run(Path(__file__).parents[2] / "configs" / "runs" / f"{name}.yaml")
    data = dump(run)
    assert json.loads(json.dumps(data)) == data  # plain data: YAML/JSON as it is
    assert parse(RunConfig, data, source="dumped") == run
