"""The bounded memo every call-path memo uses (kernel plans, served kernel objects, compat signatures)."""

from tkjit.memo import Memo


def test_a_full_memo_starts_over_and_keeps_the_new_entry():
    m = Memo(2)
    assert m.remember("a", 1) == 1
    m.remember("b", 2)
    assert m.get("a") == 1 and len(m) == 2
    m.remember("c", 3)  # full: what it held goes, the new one stays
    assert dict(m) == {"c": 3}


def test_reset_clears_the_ops_memos():
    import tkjit
    from tkjit.api import call_memo

    m = call_memo(4)
    m.remember(("sig",), "kernel")
    tkjit.reset()
    assert not m
