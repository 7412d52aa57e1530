"""tkjit.testing's comparison with the reference (used by the tests and by the tuner's gate), on
a stand-in kernel: no compiler."""

import torch

import tkjit
from tkjit.spec import KernelSpec, Runtime, TensorArg
from tkjit.testing import check, check_configs, reference_outputs, run_against_reference, spread


def _spec() -> KernelSpec:
    return KernelSpec(
        name="double_probe", family="test", doc="", params=(Runtime("num_tokens"),),
        space={"skip": (0, 1)}, default=lambda s: {"skip": 0},
        constraint=lambda s, c: None, build=lambda s, c: None,
        inputs=(TensorArg("x", "float32", ("num_tokens",)),),
        outputs=(TensorArg("y", "float32", ("num_tokens",)), TensorArg("s", "float32", (1,))),
        make_inputs=lambda s, device="cpu", seed=0: (
            torch.randn(s["num_tokens"], generator=torch.Generator().manual_seed(seed)).to(device),),
        reference=lambda s, x: [2 * x, x.sum().reshape(1)],
        bytes_moved=lambda s: 0, examples=({"num_tokens": 8},), source_hash="x",
    )


class _Kernel:
    """Stands in for a CompiledKernel: doubles x into y and sums it into s; skip=1 leaves y's last
    element unwritten."""

    def __init__(self, skip: int) -> None:
        self.spec, self.shape, self.config = _spec(), {}, {"skip": skip}

    def __call__(self, x, out):
        y, s = out
        n = len(x) - self.config["skip"]
        y[:n] = 2 * x[:n]
        s[0] = x.sum()


def test_reference_outputs_always_a_tuple():
    spec = _spec()
    x = torch.ones(3)
    refs = reference_outputs(spec, {"num_tokens": 3}, (x,))
    assert isinstance(refs, tuple) and len(refs) == 2 and torch.equal(refs[0], 2 * x)
    spec.reference = lambda s, x: 2 * x
    (one,) = reference_outputs(spec, {"num_tokens": 3}, (x,))
    assert torch.equal(one, 2 * x)


def test_a_right_kernel_passes_and_its_outputs_come_back():
    x = torch.arange(5.0)
    outs, problem = run_against_reference(_Kernel(0), {"num_tokens": 5}, (x,), device="cpu")
    assert problem is None and torch.equal(outs[0], 2 * x) and float(outs[1]) == 10.0


def test_an_unwritten_element_is_caught_by_the_poison():
    outs, problem = run_against_reference(_Kernel(1), {"num_tokens": 5}, (torch.arange(5.0),), device="cpu")
    assert problem is not None and problem.startswith("y:") and "non-finite" in problem
    assert torch.isnan(outs[0][-1])


def test_given_references_are_used_as_they_are():
    x = torch.arange(5.0)
    wrong = (2 * x + 1, x.sum().reshape(1))
    _, problem = run_against_reference(_Kernel(0), {"num_tokens": 5}, (x,), refs=wrong, device="cpu")
    assert problem is not None and problem.startswith("y: relative error")


def test_check_names_the_kernel_config_and_sizes():
    assert check(_Kernel(0), {"num_tokens": 7}, device="cpu", seed=3) is None
    msg = check(_Kernel(1), {"num_tokens": 7}, device="cpu", seed=3)
    assert msg is not None and msg.startswith("double_probe {'skip': 1} at {'num_tokens': 7}: y: ")


def test_spread_keeps_the_ends_and_the_default():
    configs = [{"i": i} for i in range(10)]
    assert spread(configs, None) == configs and spread(configs, 10) == configs
    assert spread(configs, 4) == [{"i": 0}, {"i": 3}, {"i": 6}, {"i": 9}]
    assert spread(configs, 4, keep={"i": 5}) == [{"i": 0}, {"i": 3}, {"i": 6}, {"i": 5}]
    assert spread(configs, 1, keep={"i": 0}) == [{"i": 0}]


def test_check_configs_compiles_then_checks_each_config(monkeypatch, tmp_path):
    monkeypatch.setenv("TKJIT_CACHE_DIR", str(tmp_path / "cache"))
    tkjit.reset()
    shape = {"num_tokens": 64, "n": 4}
    assert check_configs("sinkhorn_fwd", [shape], [{"num_tokens": 1}, {"num_tokens": 37}], seeds=(0,),
                         arch="cpu", device="cpu", most=2) == []
    # A wrong reference fails every config, each failure naming its config and sizes.
    spec = tkjit.get_spec("sinkhorn_fwd")
    monkeypatch.setattr(spec, "reference", lambda s, x: x)
    failures = check_configs("sinkhorn_fwd", [shape], [{"num_tokens": 5}], seeds=(0,), arch="cpu",
                             device="cpu", most=2)
    assert len(failures) == 2 and all("{'num_tokens': 5}" in f for f in failures), failures


def test_an_in_place_input_after_an_absent_optional_one_is_found():
    """make_inputs gives the present inputs only: an in-place input after an absent optional one sits at its
    position among those (swiglu_forward_and_per_token_cast without its maps: clamped_count), not among all
    of spec.inputs (where it raised IndexError)."""
    from tkjit.spec import Static

    spec = KernelSpec(
        name="count_probe", family="test", doc="", params=(Runtime("n"), Static("has_w", bool, default=False)),
        space={"skip": (0,)}, default=lambda s: {"skip": 0}, constraint=lambda s, c: None, build=lambda s, c: None,
        inputs=(TensorArg("w", "float32", ("n",), optional="has_w"), TensorArg("x", "float32", ("n",)),
                TensorArg("count", "int32", (1,), inout=True)),
        outputs=(TensorArg("y", "float32", ("n",)),),
        make_inputs=lambda s, device="cpu", seed=0: (torch.arange(s["n"], dtype=torch.float32),
                                                     torch.zeros(1, dtype=torch.int32)),
        reference=lambda s, x, count: (count + 1, 2 * x),
        bytes_moved=lambda s: 0, examples=({"n": 8},), source_hash="x",
    )

    class Kernel:
        def __init__(self, bump: int) -> None:
            self.spec, self.shape, self.config, self.bump = spec, {}, {"skip": 0}, bump

        def __call__(self, x, count, out):
            count += self.bump
            out[0].copy_(2 * x)

    full = spec.canonical_shape({"n": 8})
    inputs = spec.make_inputs(full)
    assert run_against_reference(Kernel(1), full, inputs, device="cpu")[1] is None
    assert "count" in run_against_reference(Kernel(2), full, inputs, device="cpu")[1]  # the in-place input checked
    assert int(inputs[1]) == 0  # the kernel ran on a copy


def test_a_reference_on_device_gets_the_inputs_where_they_are():
    """Specs whose maths depend on the device's library (exp) compare with a reference run on the kernel's
    device; the outputs still come back on the CPU, where the comparison runs."""
    import dataclasses

    seen = []

    def reference(s, x):
        seen.append(x)
        return 2 * x

    x = torch.randn(8)
    for on_device in (False, True):
        spec = dataclasses.replace(_spec(), reference=reference, reference_on_device=on_device)
        (y,) = reference_outputs(spec, {"num_tokens": 8}, [x])
        assert y.device.type == "cpu" and torch.equal(y, 2 * x)
    assert seen[1] is x  # as given (on a GPU host: the CUDA tensor, not a CPU copy)
