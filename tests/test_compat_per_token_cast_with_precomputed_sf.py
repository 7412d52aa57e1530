"""TileKernels' `quant.per_token_cast_with_precomputed_sf` on a CPU host, its kernels (per_token_cast's and
per_block_cast_with_sf with one-token blocks) served by their references: with the scales per_token_cast returned
(every layout) it gives per_token_cast's values bit for bit, e4m3 and e2m1; other scales give clamp(x * (1 / sf))
in e4m3, the saturating FP4 codes of x * (1 / sf) in e2m1; refusals name the argument."""

import sys
from pathlib import Path

import pytest
import torch

import tkjit.compat.tile_kernels as tk
from tkjit.errors import ShapeError, TensorError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from reference_kernels import serve_references  # noqa: E402

pytestmark = pytest.mark.usefixtures("module_cache")
KERNELS = ("per_token_cast", "per_token_cast_colmajor", "per_token_cast_e2m1", "per_token_cast_e2m1_colmajor",
           "per_block_cast_with_sf")


@pytest.fixture
def refs(monkeypatch):
    return serve_references(monkeypatch, KERNELS)


def _x(n, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hidden, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))).to(dtype)


@pytest.mark.parametrize("col, packed", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_with_its_own_scales_it_is_per_token_cast(refs, col, packed, group, fmt):
    x = _x(37, 512, seed=group)
    q, sf = tk.quant.per_token_cast(x, fmt, group, use_tma_aligned_col_major_sf=col, round_sf=True,
                                    use_packed_ue8m0=packed)
    q2 = tk.quant.per_token_cast_with_precomputed_sf(x, fmt, group, sf, use_tma_aligned_col_major_sf=col,
                                                     use_packed_ue8m0=packed)
    assert q2.dtype == q.dtype and q2.shape == q.shape
    assert q2.shape == ((37, 256) if fmt == "e2m1" else x.shape)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_other_scales_give_clamped_x_times_inverse(refs):
    x = _x(9, 256, torch.float32, seed=3)
    sf = torch.rand(9, 2) * 0.01 + 1e-3  # small scales: many values saturate at 448
    q = tk.quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, sf)
    want = (x * (1 / sf).repeat_interleave(128, dim=1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def test_other_scales_give_saturating_e2m1_codes(refs):
    from tkjit_kernels.quant import _e2m1

    x = _x(9, 256, torch.float32, seed=4)
    sf = torch.rand(9, 8) * 0.01 + 1e-3  # small scales: many values saturate at 6
    q = tk.quant.per_token_cast_with_precomputed_sf(x, "e2m1", 32, sf)
    y = x * (1 / sf).repeat_interleave(32, dim=1)
    assert q.dtype == torch.int8 and q.shape == (9, 128)
    assert torch.equal(q, _e2m1.pack(_e2m1.encode(y))) and (y.abs() > 6).any()


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("hidden, group", [(640, 256), (512, 512), (576, 576), (640, 96), (640, 48)])
def test_wider_groups_take_their_group_scale(refs, fmt, hidden, group):
    # Groups wider than a kernel block (hidden itself, or 256 with a partial last group) reuse one scale
    # across the group's blocks: the same values as the formula, channel by channel.
    from tkjit_kernels.quant import _e2m1

    x = _x(5, hidden, torch.float32, seed=group)
    groups = -(-hidden // group)
    sf = torch.rand(5, groups) * 0.02 + 1e-3
    q = tk.quant.per_token_cast_with_precomputed_sf(x, fmt, group, sf)
    y = x * (1 / sf).repeat_interleave(group, dim=1)[:, :hidden]
    if fmt == "e4m3":
        want = y.clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    else:
        assert torch.equal(q, _e2m1.pack(_e2m1.encode(y)))


@pytest.mark.parametrize("args, error, match", [
    (("e5m6", 128, torch.ones(4, 2)), ShapeError, "takes no precomputed sf"),
    (("e3m4", 128, torch.ones(4, 2)), ShapeError, "fmt must be one of"),
    (("e2m1", 8, torch.ones(4, 32)), NotImplementedError, "num_per_channels=8"),
    (("e4m3", 24, torch.ones(4, 11)), NotImplementedError, "num_per_channels=24"),
    (("e4m3", 128, torch.ones(4, 3)), TensorError, "sf must have shape"),
    (("e4m3", 128, torch.ones(4, 2).double()), TensorError, "sf"),
], ids=["e5m6", "e3m4", "e2m1 group8", "group24", "sf shape", "sf dtype"])
def test_refusals_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        tk.quant.per_token_cast_with_precomputed_sf(torch.zeros(4, 256), *args)


def test_packed_needs_column_major():
    with pytest.raises(ShapeError, match="use_tma_aligned_col_major_sf=True"):
        tk.quant.per_token_cast_with_precomputed_sf(torch.zeros(4, 256), "e4m3", 128,
                                                    torch.ones(4, 1, dtype=torch.int32), use_packed_ue8m0=True)
