"""Checks for tests run under the ``transfer_mode`` fixture (tests/conftest.py)."""

from __future__ import annotations


def assert_copies_were_deferred(transfer_mode) -> None:
    """In ``"deferred"`` mode: copies were queued, and more than one was in flight at once (the seam was used)."""
    mode, ops = transfer_mode
    if mode != "deferred":
        return
    assert ops, "no DeferredOps was built: the CPU path did not go through the stream transfer"
    assert sum(o.copies_queued for o in ops) > 0
    assert max(o.most_in_flight for o in ops) > 1, "every copy landed before the next was queued"
    assert all(o.in_flight() == 0 for o in ops), "copies were still queued at the end of fit"
