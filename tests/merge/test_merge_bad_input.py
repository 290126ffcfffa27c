"""Bad input to merge_partial_ (no communication): meta tensors and an
output whose elements share memory."""

from __future__ import annotations

import pytest
import torch

import cplib
from cplib.comm.native import ops  # raises a kernel's error as its Python class


def test_merge_rejects_meta_and_expanded_out():
    out, lse = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), float("-inf"))
    blk, blk_lse = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="blk_out on the meta device"):
        cplib.merge_partial_(out, lse, blk.to("meta"), blk_lse)
    with pytest.raises(ValueError, match="inputs mix the meta device"):
        ops.merge_partial_(out, lse, blk.to("meta"), blk_lse)
    expanded = torch.zeros(1, 2, 1, 8).expand(1, 2, 4, 8)
    with pytest.raises(ValueError, match="out .*share memory"):
        cplib.merge_partial_(expanded, lse, blk, blk_lse)
    cplib.merge_partial_(out, lse, blk, blk_lse)  # the valid call still merges
    torch.testing.assert_close(out, blk)
