"""The one layout vocabulary (cplib/attention/names.py), in one process:
``Layout``'s members are the native layer's names, the public booleans read
into one layout, every layout has its words for the errors; the load
balancers' layouts (``ShardLayout.kind``) and the hybrid layers'
(``SequenceLayout``) are its members."""

from __future__ import annotations

import pytest

import cplib
from cplib.attention.names import DOCUMENT_LAYOUTS, LAYOUTS, Layout, layout_of, layout_words
from cplib.frontend.shard_layout import shard_layout_of
from cplib.hybrid.layout import SequenceLayout


def test_layout_is_the_native_names():
    assert [str(x) for x in Layout] == list(LAYOUTS)
    assert set(DOCUMENT_LAYOUTS) == {Layout.PER_DOCUMENT, Layout.PLACEMENT}
    assert Layout("head_tail") is Layout.HEAD_TAIL and Layout.HEAD_TAIL == "head_tail"


def test_public_booleans_read_into_one_layout():
    assert layout_of("op") is Layout.SEQUENTIAL
    assert layout_of("op", load_balanced=True) is Layout.HEAD_TAIL
    assert layout_of("op", True, per_document=True) is Layout.PER_DOCUMENT
    assert layout_of("op", placement=True) is Layout.PLACEMENT
    with pytest.raises(ValueError, match="cplib.op: per_document and placement are two"):
        layout_of("op", per_document=True, placement=True)


def test_every_layout_has_its_words():
    assert [layout_words(x) for x in Layout] == [
        {"sequential": "sequential", "head_tail": "head-tail",
         "per_document": "per-document head-tail", "placement": "document placement"}[str(x)]
        for x in Layout]


class _Reversed(cplib._LoadBalancer):
    def _generate_indices(self, restore: bool = False):
        return None


def test_load_balancers_name_their_layout():
    s, n, cu = 32, 2, [0, 5, 20, 32]
    kinds = {
        None: Layout.SEQUENTIAL,
        cplib._HeadTailLoadBalancer(s, n, "cpu"): Layout.HEAD_TAIL,
        cplib.AnyLengthHeadTailLoadBalancer(s + 2, n, "cpu"): Layout.HEAD_TAIL,
        cplib.AnyLengthPerDocumentLoadBalancer(cu, n, "cpu"): Layout.PER_DOCUMENT,
        cplib.DocumentPlacementLoadBalancer(cu, n, "cpu"): Layout.PLACEMENT,
        cplib.usp_load_balancer(s, n, 1): Layout.HEAD_TAIL,
        cplib.usp_load_balancer(s, n, 1, head_tail=False): Layout.SEQUENTIAL,
        cplib.usp_load_balancer(s, n, 1, cu_seqlens=cu): Layout.PER_DOCUMENT,
        _Reversed(): None,  # a balancer of the user's own: SDPA cannot read its layout
    }
    for lb, kind in kinds.items():
        assert shard_layout_of(lb).kind is kind, (type(lb).__name__, shard_layout_of(lb))


def test_sequence_layout_takes_a_layout_it_reads_in_order():
    layout = SequenceLayout("g", 2, 0, 8, Layout.HEAD_TAIL)
    assert layout.head_tail and layout.pieces() == [(0, 2), (6, 2)]
    assert SequenceLayout("g", 2, 0, 8, Layout.SEQUENTIAL).pieces() == [(0, 4)]
    for bad in (True, Layout.PER_DOCUMENT, "head-tail"):
        with pytest.raises(ValueError, match="SequenceLayout's layout must be one of"):
            SequenceLayout("g", 2, 0, 8, bad)
