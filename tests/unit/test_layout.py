"""Flat layout and shard math (pure)."""

import math

import pytest
import torch

from hsdp.sharding.layout import ALIGN_ELEMS, FlatLayout, boxes

SHAPES = [(7, 13), (13,), (1,), (5, 3, 2), (0,), (129,)]


@pytest.mark.parametrize("outer,inner,shard_outer",
                         [(1, 1, False), (2, 4, False), (2, 4, True), (4, 1, True), (3, 5, True)])
def test_shards_partition_every_parameter_exactly_once(outer, inner, shard_outer):
    lay = FlatLayout.build(SHAPES, inner, outer, shard_outer)
    assert lay.total % (inner * (outer if shard_outer else 1) * ALIGN_ELEMS) == 0
    assert all(off % ALIGN_ELEMS == 0 for off in lay.offsets)
    covered = [0] * len(SHAPES)
    owners = [(o, i) for o in range(outer if shard_outer else 1) for i in range(inner)]
    seen_ranges = []
    for o, i in owners:
        lo, hi = lay.owned_range(o, i)
        assert hi - lo == lay.chunk_numel
        seen_ranges.append((lo, hi))
        for pc in lay.pieces(lo, hi):
            if pc is not None:
                covered[pc.index] += pc.length
                assert 0 <= pc.range_offset and pc.range_offset + pc.length <= hi - lo
    assert covered == [math.prod(s) for s in SHAPES]
    assert sorted(seen_ranges)[0][0] == 0 and sorted(seen_ranges)[-1][1] == lay.total


def test_hfsdp_chunk_is_inside_the_inner_shard():
    lay = FlatLayout.build(SHAPES, 4, 2, True)
    for i in range(4):
        ilo, ihi = lay.inner_range(i)
        for o in range(2):
            lo, hi = lay.owned_range(o, i)
            assert ilo <= lo < hi <= ihi and lo - ilo == o * lay.chunk_numel


def test_gaps_are_the_complement_of_the_parameters():
    lay = FlatLayout.build(SHAPES, 2, 2, False)
    used = sum(lay.numels) + sum(b - a for a, b in lay.gaps())
    assert used == lay.total
    for a, b in lay.gaps():
        for off, n in zip(lay.offsets, lay.numels):
            assert b <= off or a >= off + n


def test_segments_lay_out_the_buffer_front_to_back():
    """Splitting a buffer by the segments' lengths gives every parameter its window."""
    lay = FlatLayout.build(SHAPES, 2, 2, False)
    segments = lay.segments()
    assert sum(n for n, _ in segments) == lay.total
    assert [i for _, i in segments if i is not None] == list(range(len(SHAPES)))
    buf = torch.arange(lay.total)
    views = buf.split([n for n, _ in segments])
    for view, (_, i) in zip(views, segments):
        if i is None:
            assert any(a <= int(view[0]) and int(view[-1]) < b for a, b in lay.gaps())
        else:
            off = lay.offsets[i]
            assert torch.equal(view, buf[off:off + lay.numels[i]])


def test_empty_group_and_bad_sizes():
    assert FlatLayout.build([], 4, 2, True).total == ALIGN_ELEMS * 8
    with pytest.raises(ValueError):
        FlatLayout.build(SHAPES, 0, 1, False)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 0, 3)])
def test_boxes_cover_a_flat_range_in_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    full = torch.arange(n).reshape(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            bxs = boxes(shape, lo, hi)
            assert sum(b.numel for b in bxs) == hi - lo
            assert len(bxs) <= max(1, 2 * len(shape) - 1)
            for b in bxs:
                block = full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
                assert torch.equal(block.reshape(-1),
                                   torch.arange(lo + b.start, lo + b.start + b.numel))
