"""The dispatcher's path to the ops: spare a call that needs no gradient custom_op's Python layers
(`lean_dispatch`), and bump the versions of the arguments a mutating op is given (`version_bump`)."""

from collections.abc import Callable

import torch

LEAN_OPS: set[str] = set()  # the ops whose autograd kernel is the lean one (lean_dispatch; tools/hostcost.py)
LEAN_SKIPPED: dict[str, str] = {}  # why this torch kept its own kernels: each reason -> the first op it hit


def _override(op, key: str, fn, with_keyset: bool = True) -> RuntimeError | None:
    """Register fn as op's kernel for dispatch key `key` in place of custom_op's; where this torch refuses the
    override, its own kernel stays (the refusal is returned)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch warns that a kernel is overridden)
        try:
            try:
                op._lib.impl(op._name, fn, key, with_keyset=with_keyset, allow_override=True)
            except TypeError:  # a torch before `allow_override` (2.11): its Python-side check refuses a second
                # kernel for a key custom_op registered; the dispatcher itself takes it (as allow_override does)
                getattr(torch.library, "_impls", set()).discard(f"{op._lib.ns}/{op._name}/{key}")
                op._lib.impl(op._name, fn, key, with_keyset=with_keyset)
        except RuntimeError as e:
            return e
    return None


def _skipped(op, e: BaseException) -> None:
    LEAN_SKIPPED.setdefault(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", op._name)


def _redispatcher(overload) -> Callable:
    """overload.redispatch without its Python frame where this torch's handle has it (redispatch_boxed)."""
    return getattr(getattr(overload, "_handle", None), "redispatch_boxed", None) or overload.redispatch


def version_bump(op) -> None:
    """The version bump of an op that mutates an argument, so a call that leaves out a mutable argument with a
    default (`Tensor(a!)? x=None`: top2_sum_gate, swiglu_forward_and_per_token_cast) works. torch before 2.12
    indexed the dispatcher's args for it, and the dispatcher drops arguments left at their default: IndexError
    (pytorch#176078). As torch's later fix does, a mutated argument that is given gets its version bumped, one
    left out is skipped."""
    from torch._library import utils

    try:
        overload = op._opoverload
        schema = overload._schema
        if not schema.is_mutable or schema._is_view_op():
            return
        idxs, keys = utils.mutated_args_kwargs(schema)
        redispatch, after = _redispatcher(overload), torch._C._after_ADInplaceOrView_keyset
        bump = torch.autograd.graph.increment_version
    except AttributeError:
        return

    def version_bump(keyset, *args, **kwargs):
        for i in idxs:
            if i < len(args) and args[i] is not None:
                bump(args[i])
        for k in keys:
            if kwargs.get(k) is not None:
                bump(kwargs[k])
        return redispatch(keyset & after, *args, **kwargs)

    _override(op, "ADInplaceOrView", version_bump)


def lean_dispatch(op) -> None:
    """Spare a dispatcher call the Python layers `custom_op` puts around an op's implementation when they have
    nothing to do (about half of the ~8 us they add; `tools/hostcost.py`). Autograd: without a tensor that needs a
    gradient, straight below autograd (with one, torch's own autograd kernel: the registered backward, or the
    error of an op that has none); the implementation: the function itself, not torch's wrapper of it (that
    wrapper checks in-place and out= returns, which these ops do not declare, and the aliasing of outputs,
    which their tests check). Where this torch names things otherwise, its own kernels stay."""
    from torch import _C

    try:
        from torch._library.autograd import make_autograd_impl
    except ImportError as e:
        return _skipped(op, e)
    try:
        overload, fns, impl = op._opoverload, op._backend_fns, op._init_fn
        redispatch = _redispatcher(overload)
        below, needs_grad, grad_on = _C._after_autograd_keyset, _C._any_requires_grad, _C.is_grad_enabled
        below_autograd = _C._AutoDispatchBelowAutograd
        needs_grad(torch.empty(0), None)  # (positionally: a torch whose check takes no keywords takes these)
    except (AttributeError, TypeError) as e:
        return _skipped(op, e)
    with_grad = []  # torch's autograd kernel, made at the first call that needs it (~0.3 ms an op)

    def autograd(keyset, *args, **kwargs):
        if grad_on() and needs_grad(*args, *kwargs.values()):
            if not with_grad:
                with_grad.append(make_autograd_impl(overload, op))
            return with_grad[0](keyset, *args, **kwargs)
        with below_autograd():
            return redispatch(keyset & below, *args, **kwargs)

    refused = _override(op, "Autograd", autograd)
    if refused is None:
        LEAN_OPS.add(op._name)
    else:
        _skipped(op, refused)
    if list(fns) == [None] and impl is not None and not overload._schema.is_mutable:
        _override(op, "CompositeExplicitAutograd", impl, with_keyset=False)
