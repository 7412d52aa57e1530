"""per_token_cast spec on the CPU: shapes, constraints, reference semantics, sm_90a cross-compiles."""

import pytest
import torch

import tkjit
from tkjit.errors import ConfigError, ShapeError
from tkjit.registry import get_spec
from tkjit.spec import validate

NAME = "per_token_cast"


@pytest.fixture(scope="module")
def spec():
    return get_spec(NAME)


def _shape(**kw):
    return {"num_tokens": 16, "hidden": 256, "group": 128, **kw}


def test_spec_validates(spec):
    validate(spec)
    assert spec.family == "quant"
    assert spec.tolerance.exact
    for ex in spec.examples:
        full = spec.canonical_shape(ex)
        assert spec.default_config(full, "sm_90a") in spec.configs(full, "sm_90a")


@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "hidden,group",
    [(7168, 128), (7168, 32), (4096, 64), (576, 32), (576, 64), (576, 576), (7168, 7168), (4096, 4096), (16, 16),
     (65536, 65536), (1152, 1152)],
)
def test_defaults_valid(spec, in_dtype, hidden, group):
    full = spec.canonical_shape(_shape(hidden=hidden, group=group, in_dtype=in_dtype))
    cfg = spec.default_config(full, "sm_90a")
    assert spec.check_config(full, cfg, "sm_90a") == cfg
    assert group // cfg["group_threads"] <= 128


def test_bad_shapes(spec):
    with pytest.raises(ShapeError, match="hidden=576 must be a multiple of group=128"):
        spec.canonical_shape(_shape(hidden=576, group=128))
    with pytest.raises(ShapeError, match="group=48 must be one of"):
        spec.canonical_shape(_shape(hidden=576, group=48))
    with pytest.raises(ShapeError, match="in_dtype.*not allowed"):
        spec.canonical_shape(_shape(in_dtype="float16"))
    with pytest.raises(ShapeError, match="must be a str"):
        spec.canonical_shape(_shape(in_dtype=torch.bfloat16))
    with pytest.raises(ShapeError, match="must be a bool"):
        spec.canonical_shape(_shape(round_scale=1))
    with pytest.raises(ShapeError, match="multiple of 16"):
        spec.canonical_shape(_shape(hidden=24, group=24))
    with pytest.raises(ShapeError, match="power-of-two"):
        spec.canonical_shape(_shape(hidden=16 * 1001, group=16 * 1001))


def test_bad_configs(spec):
    full = spec.canonical_shape(_shape(in_dtype="float32"))
    with pytest.raises(ConfigError, match="at most 32 bytes"):
        spec.check_config(full, {"vec": 16, "group_threads": 4, "threads": 256, "iters": 1})
    with pytest.raises(ConfigError, match="spill"):
        spec.check_config(
            spec.canonical_shape(_shape(hidden=1024, group=1024)),
            {"vec": 8, "group_threads": 4, "threads": 256, "iters": 1},
        )
    with pytest.raises(ConfigError, match="CUDA targets only"):
        spec.check_config(full, spec.default_config(full), "cpu")


def test_output_dims(spec):
    full = spec.canonical_shape(_shape(num_tokens=3, hidden=7168, group=128))
    (o, odt, odims), (s, sdt, sdims) = spec.output_decls(full)
    assert (o, odt, odims) == ("out", "float8_e4m3fn", (3, 7168))
    assert (s, sdt, sdims) == ("scales", "float32", (3, 56))
    assert spec.bytes_moved(full) == 3 * (7168 * 3 + 56 * 4)
    assert spec.bytes_moved({**full, "in_dtype": "float32"}) == 3 * (7168 * 5 + 56 * 4)


def test_reference_hand_checked(spec):
    s = spec.canonical_shape({"num_tokens": 2, "hidden": 64, "group": 32, "in_dtype": "float32"})
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-7.0, 3.5, 32)  # amax 7 -> scale 7/448 = 1/64, values * 64
    x[0, 32:] = 1e-6  # under the clamp: amax 1e-4
    x[1, :32] = 448.0
    x[1, 5] = -896.0  # amax 896 -> scale 2, -896 -> -448, 448 -> 224
    q, sf = spec.reference(s, x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 64)
    assert sf.dtype == torch.float32 and sf.shape == (2, 2)
    assert sf[0, 0].item() == pytest.approx(7 / 448) and sf[1, 0].item() == 2.0
    assert sf[0, 1].item() == torch.tensor(1e-4) / torch.tensor(448.0)
    assert sf[1, 1].item() == torch.tensor(1e-4) / torch.tensor(448.0)  # zeros: clamped amax
    assert q[0, 0].float().item() == -448.0
    assert q[1, 5].float().item() == -448.0 and q[1, 0].float().item() == 224.0
    assert (q[1, 32:].float() == 0).all()
    # 1e-6 * 448/1e-4 = 4.48 -> nearest e4m3 is 4.5
    assert q[0, 40].float().item() == 4.5
    # dequantised values are close to x
    deq = q.float() * sf.repeat_interleave(32, 1)
    assert torch.allclose(deq[0, :32], x[0, :32], rtol=0.07)


def test_reference_round_scale(spec):
    s = spec.canonical_shape({"num_tokens": 1, "hidden": 32, "group": 32, "in_dtype": "float32", "round_scale": True})
    x = torch.full((1, 32), 3.0)
    x[0, 0] = 5.0  # 5/448 -> rounded up to 2^-6 = 1/64; 5*64 = 320, 3*64 = 192
    q, sf = spec.reference(s, x)
    assert sf.item() == 2.0**-6
    assert q[0, 0].float().item() == 320.0 and q[0, 1].float().item() == 192.0
    x2 = torch.full((1, 32), 448.0 * 2**-3)  # exact power of two stays
    assert spec.reference(s, x2)[1].item() == 2.0**-3


def test_make_inputs(spec):
    full = spec.canonical_shape(_shape(num_tokens=40, hidden=576, group=64))
    (x,) = spec.make_inputs(full, "cpu", 3)
    assert x.dtype == torch.bfloat16 and x.shape == (40, 576)
    assert (x[5] == 0).all() and x[3].abs().max() < 1e-4
    (y,) = spec.make_inputs({**full, "in_dtype": "float32"}, "cpu", 3)
    assert y.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,config",
    [
        ({"hidden": 7168, "group": 128}, None),  # the DeepSeek default: bf16, 16-byte loads
        ({"hidden": 7168, "group": 7168, "in_dtype": "float32"}, None),  # cross-warp (shared) reduction
        ({"hidden": 576, "group": 32, "round_scale": True}, {"vec": 16, "group_threads": 2, "threads": 128,
                                                             "iters": 4}),
        ({"hidden": 4096, "group": 64, "in_dtype": "float32"}, {"vec": 4, "group_threads": 1, "threads": 512,
                                                                 "iters": 1}),
    ],
)
def test_compiles_for_sm90a(cache_dir, shape, config):
    k = tkjit.get(NAME, {"num_tokens": 4001, **shape}, arch="sm_90a", config=config)
    src = (k.path / "kernel.cu").read_text()
    assert "__fdiv_rn" in src  # IEEE divisions whatever the fast-math setting
    if shape.get("round_scale"):
        assert "8388607" in src or "0x7fffff" in src.lower()
