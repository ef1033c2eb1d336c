"""Configuration text shared by sim.Pool and enable(): keyword options, CUDAPOOL_CONF, and
their merge (keywords win per key). No torch needed."""

import pytest
from cudapool import _C, _config
from cudapool.sim import config_string


def test_split_entries_keeps_bracketed_lists_whole():
    text = "max_split_size_mb:64, roundup_power2_divisions:[256:1,512:2,>:4] ,,garbage_collection_threshold:0.5"
    assert _config.split_entries(text) == [
        "max_split_size_mb:64",
        "roundup_power2_divisions:[256:1,512:2,>:4]",
        "garbage_collection_threshold:0.5",
    ]
    assert _config.split_entries("") == []


def test_keywords_replace_environment_entries_per_key():
    merged = _config.merge("max_split_size_mb:64,garbage_collection_threshold:0.5", {"max_split_size_mb": 128})
    assert [e.text for e in merged.values()] == ["max_split_size_mb:128", "garbage_collection_threshold:0.5"]
    assert merged["max_split_size_mb"].source == "keyword argument"
    assert merged["garbage_collection_threshold"].source == "CUDAPOOL_CONF"


def test_later_environment_entry_of_a_key_wins():
    merged = _config.merge("max_split_size_mb:64,max_split_size_mb:96", {})
    assert [e.text for e in merged.values()] == ["max_split_size_mb:96"]


def test_resolve_reads_the_given_environment():
    text = _config.resolve({"memory_fraction": 0.5}, env={"CUDAPOOL_CONF": "max_split_size_mb:64"})
    assert text == "max_split_size_mb:64,memory_fraction:0.5"
    assert _config.resolve({}, env={}) == ""
    effective = _config.effective(text)
    assert effective == _C.parse_config("memory_fraction:0.5,max_split_size_mb:64")


def test_bad_environment_key_is_named_with_its_source():
    with pytest.raises(ValueError, match=r"'bogus'.*\(from CUDAPOOL_CONF\)"):
        _config.resolve({}, env={"CUDAPOOL_CONF": "max_split_size_mb:64,bogus:1"})


def test_entry_without_a_colon_is_named():
    with pytest.raises(ValueError, match="max_split_size_mb"):
        _config.resolve({}, env={"CUDAPOOL_CONF": "max_split_size_mb"})


def test_keyword_replacing_a_bad_environment_value_is_valid():
    assert (
        _config.resolve({"max_split_size_mb": 64}, env={"CUDAPOOL_CONF": "max_split_size_mb:abc"})
        == "max_split_size_mb:64"
    )


def test_bad_combination_is_reported_as_a_whole():
    with pytest.raises(ValueError, match="invalid configuration"):
        # each valid alone; together max_split_size does not exceed the large segment
        _config.resolve({"max_split_size_mb": 32}, env={"CUDAPOOL_CONF": "large_segment_mb:40"})


def test_sim_config_string_is_the_shared_helper():
    assert config_string({"expandable_segments": False, "roundup_power2_divisions": {256: 1, ">": 4}}) == (
        "expandable_segments:False,roundup_power2_divisions:[256:1,>:4]"
    )
    with pytest.raises(ValueError, match="invalid config option 'nope' = 1"):
        config_string({"nope": 1})


def test_policies_go_under_the_environment_and_the_keywords():
    from cudapool import _config, policies

    default = _config.effective(_config.resolve({}, env={}, use_policy=True))
    assert default == _config.effective(policies.config_for("cudapool"))
    assert "release_before_grow:True" in default
    builtin = _config.effective(_config.resolve({"policy": "builtin"}, env={}, use_policy=True))
    assert builtin == _config.effective("")  # the built-in allocator's rules are the C defaults
    from_env = _config.resolve({}, env={"CUDAPOOL_CONF": "policy:builtin,max_split_size_mb:64"}, use_policy=True)
    assert "release_before_grow" not in from_env and "max_split_size_mb:64" in from_env
    # a keyword wins over the policy's entry of the same key
    text = _config.resolve({"max_split_size_mb": 256}, env={}, use_policy=True)
    assert "max_split_size_mb:256" in _config.effective(text)
    with pytest.raises(ValueError, match="no_such_policy"):
        _config.resolve({"policy": "no_such_policy"}, env={}, use_policy=True)
    with pytest.raises(ValueError, match="from CUDAPOOL_CONF"):
        _config.resolve({}, env={"CUDAPOOL_CONF": "policy:nope"}, use_policy=True)
