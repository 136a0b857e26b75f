"""The strategy is parsed once, at the API, into ``hsdp.Strategy``."""

import pytest

import hsdp
from hsdp.sharding.policy import Strategy


def test_parse_takes_the_enum_or_its_value_and_names_the_choices():
    assert Strategy.parse("hfsdp") is Strategy.HFSDP is Strategy.parse(Strategy.HFSDP)
    assert Strategy.HFSDP == "hfsdp" and hsdp.Strategy is Strategy
    assert Strategy.HFSDP.shards_outer and not Strategy.HSDP.shards_outer
    with pytest.raises(ValueError, match=r"unknown strategy 'fsdp'.*\['hsdp', 'hfsdp'\]"):
        Strategy.parse("fsdp")

