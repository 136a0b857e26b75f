"""The simulator's virtual clock: virtual streams record a program, which is timed on a
virtual clock (one rank, or every rank at once)."""

import pytest
import torch

from hsdp.streams.stream_set import Streams
from hsdp_tools.sim.clock import virtual_streams
from hsdp_tools.sim.engine import RecordedCollectives


def _price(op):
    """Host 1 s per compute or side op; compute ops 5 s on the device, side ops 3 s."""
    return {"compute": (1.0, 5.0), "side": (1.0, 3.0)}.get(op.kind, (0.0, 0.0))


def test_virtual_streams_time_the_program_on_a_virtual_clock():
    s, p = virtual_streams()
    p.compute("A")  # host 0-1, device 1-6
    ready = s.compute.record()  # event at 6
    ag = s.ag.submit(lambda: None, [ready], "AG")  # issued at 2, starts at 6: 6-9
    s.compute.begin("FWD:x")
    p.compute("B")  # issued at 3, queued behind A: 6-11
    p.compute("B2")  # issued at 4: 11-16, merged with B (same phase, back to back)
    s.compute.end("FWD:x")
    s.compute.wait(ag)  # AG ended at 9: no stall
    rs = s.rs.submit(lambda: None, [ag], "RS")  # issued at 5: 9-12
    p.compute("C")  # issued at 6: 16-21
    s.compute.wait(rs)  # RS ended at 12: no stall
    s.outer.submit(lambda: None, [], "OUTER").synchronize()  # issued at 7: 7-10; host to 10
    p.compute("D")  # issued at 11: 21-26, merged with C (back to back, no phase between)
    t = p.evaluate(_price)
    got = [(r.stream, r.label, r.start_s, r.end_s) for r in t.records]
    assert got == [("compute", "compute", 1, 6), ("ag", "AG", 6, 9),
                   ("compute", "begin:FWD:x", 6, 6), ("compute", "FWD:x", 6, 16),
                   ("compute", "end:FWD:x", 16, 16), ("compute", "wait:AG", 16, 16),
                   ("rs", "RS", 9, 12), ("compute", "compute", 16, 26),
                   ("compute", "wait:RS", 21, 21), ("outer", "OUTER", 7, 10)]
    assert t.end_s[-1] == 26 and t.host_busy_s == 8
    # Compute on the host thread (as on CPU): the host waits for each compute op. From op
    # 8 (the RS) on: RS 20-23, C 21-26, OUTER 27-30, the sync until 30, D 31-36.
    blocking = p.evaluate(_price, start=8, host_blocks=True)
    assert [(r.label, r.start_s, r.end_s) for r in blocking.records] == [
        ("RS", 20, 23), ("compute", 21, 26), ("wait:RS", 26, 26), ("OUTER", 27, 30),
        ("compute", 31, 36)]
    assert blocking.host_busy_s == 4


def test_side_ops_tensor_work_holds_up_compute():
    """With ``shared_sms``, each half of a side op's own tensor work (before and after its
    collective) takes the SMs when it is ready: a compute op running then ends as much
    later, one ready meanwhile waits for it; the collective runs beside compute."""

    def price(op):  # side op: 5 s on its stream, of which 4 s of its own tensor work
        return {"compute": (1.0, 5.0), "side": (1.0, 5.0, 4.0)}.get(op.kind, (0.0, 0.0))

    s, p = virtual_streams()
    s.ag.submit(lambda: None, [], "AG")  # issued at 1: casts 1-3, collective 3-4, casts 4-6
    p.compute("A")  # issued at 2, waits for the first casts: 3-4, held up: 6-10
    timing = p.evaluate(price, shared_sms=True)
    got = [(r.label, r.start_s, r.end_s) for r in timing.records]
    assert got == [("AG", 1, 6), ("compute", 3, 4), ("compute", 6, 10)]
    alone = [(r.label, r.start_s, r.end_s) for r in p.evaluate(price).records]
    assert alone == [("AG", 1, 6), ("compute", 2, 7)]


def test_compute_slows_beside_a_collective():
    """A compute op's drag: while a collective runs on a side stream (its kernel on the
    GPU, from its start to its end), the compute op beside it goes at ``1 - drag`` of its
    speed, also when the collective starts after it; ops without drag do not slow, nor
    does a side op without a collective of several ranks (its casts alone)."""

    def price(drag):
        def cost(op):
            return {"compute": (1.0, 4.0, drag), "side": (1.0, 2.0, 0.0)}.get(
                op.kind, (0.0, 0.0))
        return cost

    def program(group_size):
        s, p = virtual_streams()
        p.compute("A")  # issued at 1: 1-5 alone
        s.ag.submit(lambda: p.collective("all_gather", "inner", 1 << 20, group_size),
                    [], "AG")  # issued at 2: 2-4, beside A
        p.compute("B")  # issued at 3, after A
        return s, p

    s, p = program(2)
    got = [[(r.label, r.start_s, r.end_s) for r in p.evaluate(price(d)).records]
           for d in (0.0, 0.5)]
    assert got[0] == [("compute", 1, 9), ("AG", 2, 4)]  # A 1-5, B 5-9, merged
    # drag 0.5: A does 1 s of work in 1-2, 1 s in 2-4 (half speed), 2 s in 4-6; B 6-10
    assert got[1] == [("compute", 1, 10), ("AG", 2, 4)]
    alone = program(1)[1].evaluate(price(0.5))
    assert [(r.label, r.start_s, r.end_s) for r in alone.records] == got[0]
    # a side op's tensor work still stops compute outright, beside the collective too
    with_casts = p.evaluate(
        lambda op: (1.0, 2.0, 1.0) if op.kind == "side" else price(0.5)(op),
        shared_sms=True)
    # AG: casts 2-2.5, collective 2.5-3.5, casts 3.5-4; A: 1-2 (1 s), stopped 2-2.5,
    # half speed 2.5-3.5 (0.5 s), stopped 3.5-4, 2.5 s left: 4-6.5; B 6.5-10.5
    assert [(r.label, r.start_s, r.end_s) for r in with_casts.records] == [
        ("compute", 1, 2), ("compute", 2.5, 3.5), ("compute", 4, 10.5), ("AG", 2, 4)]


def test_virtual_collectives_and_events():
    s, p = virtual_streams()
    coll = RecordedCollectives(p)
    with pytest.raises(RuntimeError, match="outside a side stream"):
        coll.before("all_reduce", "outer", 64, 2)
    ev = s.ag.submit(lambda: coll.before("all_gather", "inner", 128, 4), label="AG:u")
    assert p.ops[-1].payload == (("all_gather", "inner", 128, 4),)
    with pytest.raises(RuntimeError, match="must not branch on query"):
        ev.query()
    with pytest.raises(TypeError, match="virtual streams"):
        s.rs.submit(lambda: None, [Streams.create(torch.device("cpu")).compute.record()])


def test_ranks_together_start_a_collective_when_its_whole_group_is_ready():
    """Three ranks run one program, each at its own host cost. Outer groups [0, 1] and
    [2]: rank 0's all-reduce waits on its stream for rank 1 (slow host), not for rank 2;
    the barrier before op ``barrier`` lets every host start the next part together."""
    s, p = virtual_streams()
    coll = RecordedCollectives(p)
    p.compute("A")
    s.outer.submit(lambda: coll.before("all_reduce", "outer", 64, 2), label="OUTER_AR:u")
    s.compute.wait(s.outer.submit(lambda: None, label="X"))  # a side op without peers
    s.compute.record().synchronize()
    barrier = len(p.ops)
    p.compute("B")

    def price(host_s):  # compute: host_s to issue, 5 s on the device; side ops 3 s
        return lambda op: {"compute": (host_s, 5.0), "side": (0.0, 3.0)}.get(
            op.kind, (0.0, 0.0))

    groups = {"outer": [[0, 1], [2]], "inner": [[0], [1], [2]]}
    fast, slow, alone = p.evaluate_ranks([price(1.0), price(4.0), price(1.0)], groups,
                                         barrier=barrier)
    ar = [next((r.start_s, r.end_s) for r in t.records if r.label == "OUTER_AR:u")
          for t in (fast, slow, alone)]
    # rank 1 issues the all-reduce at 4, rank 0 at 1: both run it 4-7 (rank 0's record
    # spans its wait); rank 2's group has no one else: 1-4.
    assert ar == [(1, 7), (4, 7), (1, 4)]
    # X follows the all-reduce (7-10; rank 2: 4-7); the hosts sync at 10 / 10 / 7 and
    # meet at 10: B is issued at 11 (host 1 s) / 14 (host 4 s)
    b = [[(r.start_s, r.end_s) for r in t.records if r.label == "compute"][-1]
         for t in (fast, slow, alone)]
    assert b == [(11, 16), (14, 19), (11, 16)]
    assert fast.end_s[barrier - 1] == 10 and alone.end_s[barrier - 1] == 7
    # identical costs: every rank as the program alone
    same = p.evaluate_ranks([price(1.0)] * 2, {"outer": [[0, 1]], "inner": [[0], [1]]})
    one = p.evaluate(price(1.0))
    assert all(t.end_s == one.end_s for t in same)
