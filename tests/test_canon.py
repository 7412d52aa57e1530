"""Canonical JSON is pinned: cache keys, config ids and the tuned DB are made of it, and shipped
caches and tuning DBs must keep hitting after any refactor."""

import hashlib
import json
import types

import pytest

from tkjit.canon import canonical_json
from tkjit.key import key_of
from tkjit.tuning.space import config_id
from tkjit.tuning.tuner import study_name

MATERIAL = {
    "spec": "sinkhorn_fwd", "spec_source": "0123456789abcdef", "static_shape": {"n": 4},
    "config": {"threads": 128, "block_tokens": 64, "unroll": True, "dtype": "bfloat16", "eps": 1e-06},
    "pass_configs": {}, "arch": "sm_90a",
    "toolchain": {"tilelang": "0.1.15", "tkjit": "0.1.0", "format": "2", "nvcc": "12.8.93", "note": "µ"},
}
MATERIAL_TEXT = (
    '{"arch":"sm_90a","config":{"block_tokens":64,"dtype":"bfloat16","eps":1e-06,"threads":128,"unroll":true},'
    '"pass_configs":{},"spec":"sinkhorn_fwd","spec_source":"0123456789abcdef","static_shape":{"n":4},'
    '"toolchain":{"format":"2","note":"\\u00b5","nvcc":"12.8.93","tilelang":"0.1.15","tkjit":"0.1.0"}}'
)
MATERIAL_KEY = "d0bbd2020c7ee3abcde44ccf71dae0668bfb28a1"


def test_cache_key_is_pinned():
    assert canonical_json(MATERIAL) == MATERIAL_TEXT
    assert key_of(MATERIAL) == MATERIAL_KEY == hashlib.sha256(MATERIAL_TEXT.encode()).hexdigest()[:40]


def test_format_sorted_compact_ascii():
    assert canonical_json({"b": 1.5, "a": [1, None, False], "é": "x"}) == '{"a":[1,null,false],"b":1.5,"\\u00e9":"x"}'
    assert canonical_json({"z": {"y": 1, "x": 2}}) == '{"z":{"x":2,"y":1}}'  # nested keys sorted too
    assert canonical_json([3, "a"]) == '[3,"a"]'
    assert canonical_json(float("nan")) == "NaN"  # as json.dumps: never an error


def test_mappings_read_as_dicts_and_types_kept_apart():
    assert canonical_json(types.MappingProxyType({"b": 2, "a": 1})) == '{"a":1,"b":2}'
    # 1, 1.0 and True are different configs.
    assert len({canonical_json({"n": v}) for v in (1, 1.0, True)}) == 3


def test_default_for_values_json_has_no_type_for():
    with pytest.raises(TypeError):
        canonical_json({"x": object})
    assert canonical_json({"x": {1, 2} - {2}}, default=lambda v: sorted(v)) == '{"x":[1]}'


def test_config_ids_and_study_names_are_canonical_json():
    cfg = {"threads": 128, "block_tokens": 64}
    assert config_id(cfg) == '{"block_tokens":64,"threads":128}' == canonical_json(cfg)
    assert json.loads(config_id(cfg)) == cfg
    spec = types.SimpleNamespace(name="k", source_hash="h")
    name = study_name(spec, {"n": 4}, {"num_tokens": 1024}, "sm_90a", "NVIDIA H200", {"tilelang": "0.1"})
    assert name.startswith("k n=4 num_tokens~1024 on sm_90a (NVIDIA H200) #")  # short, readable
    # ... and a hash of the whole identity keeps studies apart (another version, another study).
    assert name == study_name(spec, {"n": 4}, {"num_tokens": 1024}, "sm_90a", "NVIDIA H200", {"tilelang": "0.1"})
    assert name != study_name(spec, {"n": 4}, {"num_tokens": 1024}, "sm_90a", "NVIDIA H200", {"tilelang": "0.2"})
