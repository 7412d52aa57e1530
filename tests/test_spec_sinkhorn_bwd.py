"""sinkhorn_bwd spec and tkjit.autograd.sinkhorn on a CPU host: validation, the reference against
finite differences, sm_90a cross-compiles, and real runs of the thread layout on the C target."""

import pytest
import torch

import tkjit
from tkjit.testing import check
from tkjit_kernels.mhc.sinkhorn import reference as fwd_reference

SHAPE = {"num_tokens": 4096, "n": 4}


def spec():
    return tkjit.get_spec("sinkhorn_bwd")


def test_registered_and_valid():
    s = spec()
    assert s.family == "mhc"
    assert [p.name for p in s.runtime_params] == ["num_tokens"]
    assert [t.name for t in s.inputs] == ["grad_out", "x"]
    assert [p.name for p in s.params] == [p.name for p in tkjit.get_spec("sinkhorn_fwd").params]


def test_default_and_space():
    s = spec()
    full = s.canonical_shape(SHAPE)
    assert s.default_config(full) == {"layout": "thread", "block_tokens": 64, "threads": 64, "recip": True,
                                      "keep_p": False, "fast_math": False, "min_threads_per_sm": 512}
    assert len(s.configs(full)) > 100
    cpu = s.configs(full, arch="cpu")
    assert cpu and all(c["layout"] == "thread" and not c["fast_math"] for c in cpu)
    for n in (1, 2, 4, 8, 16):
        for repeat in (1, 10, 100):
            f = s.canonical_shape({"num_tokens": 7, "n": n, "repeat": repeat})
            assert s.constraint(f, s.default_config(f)) is None
    assert not any(c["min_threads_per_sm"] % c["threads"] for c in s.configs(full))


@pytest.mark.parametrize(
    "shape, err, match",
    [
        ({"num_tokens": 8, "n": 0}, tkjit.ShapeError, "n"),
        ({"num_tokens": 8, "n": 17}, tkjit.ShapeError, "n"),
        ({"num_tokens": 8, "repeat": 0}, tkjit.ShapeError, "repeat"),
        ({"num_tokens": 8, "eps": -1.0}, tkjit.ShapeError, "eps"),
        ({"num_tokens": 8, "eps": float("nan")}, tkjit.ShapeError, "eps"),
        ({"num_tokens": 0}, tkjit.ShapeError, "num_tokens"),
        ({"n": 4}, tkjit.ShapeError, "num_tokens"),
        ({"num_tokens": 8, "m": 4}, tkjit.ShapeError, "unknown"),
    ],
)
def test_bad_shapes(shape, err, match):
    with pytest.raises(err, match=match):
        spec().canonical_shape(shape)


def test_bad_configs():
    s = spec()
    full = s.canonical_shape(SHAPE)
    good = s.default_config(full)
    with pytest.raises(tkjit.ConfigError, match="multiple of threads"):
        s.check_config(full, {**good, "block_tokens": 32, "threads": 64})
    with pytest.raises(tkjit.ConfigError, match="thread layout"):
        s.check_config(full, {**good, "layout": "smem"}, arch="cpu")
    with pytest.raises(tkjit.ConfigError, match="missing"):
        s.check_config(full, {k: v for k, v in good.items() if k != "keep_p"})
    with pytest.raises(tkjit.ConfigError, match="not in the space"):
        s.check_config(full, {**good, "min_threads_per_sm": 1024})


def test_reference_matches_finite_differences():
    s = spec()
    full = s.canonical_shape({"num_tokens": 3, "n": 3, "repeat": 4, "eps": 1e-3})
    go, x = s.make_inputs(full, seed=5)
    gx = s.reference(full, go, x)
    assert gx.dtype == torch.float32 and gx.shape == x.shape

    def loss(xd):
        return (fwd_reference(full, xd) * go.double()).sum()

    xd = x.double()
    h = 1e-6
    for idx in [(0, 0, 0), (1, 2, 1), (2, 1, 2)]:
        e = torch.zeros_like(xd)
        e[idx] = h
        fd = (loss(xd + e) - loss(xd - e)) / (2 * h)
        assert abs(float(fd) - float(gx[idx])) < 1e-5
    # Rows of a softmax gradient sum to zero (softmax is shift-invariant per row).
    assert float(gx.double().sum(-1).abs().max()) < 1e-5


def test_inputs_are_fresh():
    s = spec()
    full = s.canonical_shape({"num_tokens": 8})
    a, b = s.make_inputs(full, seed=0), s.make_inputs(full, seed=1)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1])
    assert s.bytes_moved(full) == 3 * 8 * 16 * 4


@pytest.mark.parametrize(
    "config",
    [
        None,
        {"layout": "smem", "block_tokens": 128, "threads": 128, "recip": True, "keep_p": False, "fast_math": True,
         "min_threads_per_sm": 384},
    ],
)
def test_compiles_for_sm90a(config):
    k = tkjit.get("sinkhorn_bwd", SHAPE, arch="sm_90a", config=config)
    assert (k.path / "kernel.cu").read_text().count("__global__") >= 1


@pytest.fixture(scope="module")
def cpu_kernel():
    return tkjit.get("sinkhorn_bwd", {"num_tokens": 100, "n": 4}, arch="cpu")


@pytest.mark.parametrize("num_tokens", [1, 63, 100, 4001])
def test_runs_on_cpu(cpu_kernel, num_tokens):
    assert check(cpu_kernel, {"num_tokens": num_tokens, "n": 4}, device="cpu", seed=num_tokens) is None


def test_other_shape_and_config_on_cpu():
    shape = {"num_tokens": 37, "n": 3, "repeat": 3, "eps": 1e-4}
    cfg = {"layout": "thread", "block_tokens": 32, "threads": 32, "recip": False, "keep_p": True, "fast_math": False,
           "min_threads_per_sm": 0}
    k = tkjit.get("sinkhorn_bwd", shape, arch="cpu", config=cfg)
    for t in (37, 5):
        assert check(k, {**shape, "num_tokens": t}, device="cpu", seed=t) is None


def test_cpu_kernel_rejects_bad_tensors(cpu_kernel):
    g = torch.randn(5, 4, 4)
    with pytest.raises(tkjit.TensorError, match="dtype"):
        cpu_kernel(g.double(), g.double())
    with pytest.raises(tkjit.TensorError, match="axis"):
        cpu_kernel(g, torch.randn(6, 4, 4))
    with pytest.raises(tkjit.TensorError, match="compiled in"):
        cpu_kernel(torch.randn(5, 3, 3), torch.randn(5, 3, 3))
    with pytest.raises(tkjit.TensorError, match="2 input"):
        cpu_kernel(g)


def test_autograd_on_cpu(cpu_kernel):
    from tkjit.autograd import sinkhorn

    x = torch.randn(3, 33, 4, 4, requires_grad=True)
    y = sinkhorn(x)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_(True)
    yr = fwd_reference({"repeat": 10, "eps": 1e-6}, xd.view(-1, 4, 4)).view(xd.shape)
    yr.backward(g.double())
    assert float((y.detach().double() - yr.detach()).norm() / yr.detach().norm()) < 1e-5
    assert float((x.grad.double() - xd.grad).norm() / xd.grad.norm()) < 1e-5
    with pytest.raises(tkjit.TensorError, match="float32"):
        sinkhorn(x.detach().double())
    with pytest.raises(tkjit.TensorError, match="n, n"):
        sinkhorn(torch.randn(3, 4, 5))
