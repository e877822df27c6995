"""Equality of nested values holding tensors (plans, states, outputs), for tests."""

from __future__ import annotations

import torch


def assert_same_tree(got, want) -> None:
    """Same structure, same scalars, tensors of the same dtype, shape and values (any device)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu())
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_tree(g, w)
    else:
        assert got == want
