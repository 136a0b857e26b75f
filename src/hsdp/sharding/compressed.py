"""The compressed outer reduction of one parameter group, and its error-feedback residual.

Runs where the exact outer reduction runs (the op table's ``OUTER_QAR`` / ``OUTER_QRS``:
the outer stream and communicator). Over ``n`` outer ranks, on the inner shard ``x``:

- reduce-scatter (hfsdp's, and the first half of hsdp's all-reduce): ``x`` plus the
  residual is cut into ``n`` rows (``quant.Rows``), quantized blockwise, exchanged with one
  all-to-all; each rank dequantizes the ``n`` rows it received and sums them in fp32 (then
  divides by ``n`` for a mean: gloo has no AVG, and NCCL's would not see fp32 sums);
- hsdp's all-reduce goes on with an all-gather of every rank's reduced row, quantized
  again; every rank (the row's owner too) uses the dequantized rows, so the replicas'
  gradients stay identical.

Bytes per rank on the outer link, ``S`` elements: ``(n-1)/n * S * (1 + 4/block)`` for the
reduce-scatter, twice that for the all-reduce (bf16's ring all-reduce: ``4 (n-1)/n S``).

Error feedback: what the first quantization dropped stays in this rank's residual; what
the second (hsdp) dropped from the row this rank owns is added to its residual's row too,
times ``n`` for a mean (the row's next reduction divides it by ``n`` again), so every
dropped bit re-enters the next step's reduction once.

Under CUDA graphs (``make_static``, when a capture begins) the residual lives in fixed
buffers, as a graph's replay reads and writes the addresses its capture saw: the committed
residual and the pending one, with a device flag that says whether the pending one is set
(``quant.Pending``); a reduction reads the pending residual where the flag is set, else the
committed one, and writes its new residual into the pending buffer; a commit copies it into
the committed buffer where the flag is set (``quant.commit_pending``: one pass over the
residual per optimizer step), a drop clears the flag. The flag is kept in eager steps too,
so that a capture may begin at any point. What a reduction does is then decided on the
device: a graph replayed once per microbatch (each backward a reduction) chains the
residual as eager backwards do.

The residual is training state only once the optimizer applied the gradients it belongs
to: a reduction's new residual is pending (``_pending``) until an optimizer step
(``commit``); gradients discarded before one (cleared by ``zero_grad``, a skipped step, an
abandoned step and its replayed collectives) discard it (``drop``). A backward that
accumulates into the pending gradients starts from the pending residual, so the errors
of the step's backwards telescope. A block with a NaN or inf (in the gradient, or in
what a reduction made of it) dequantizes non-finite, so the reduced gradient shows it;
its new residual, like one with a value whose square overflows fp32 (``LIMIT``: a 1e30
outlier's rounding), keeps the block's value from before the reduction: the residual is
always finite, and no value of it alone makes a later step's norm inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hsdp.sharding.comm import Collectives
from hsdp.sharding.quant import (
    Keep,
    Pending,
    Rows,
    commit_pending,
    decode_into,
    encode,
    keep_finite,
    reduce_requantize,
    reduce_rows,
)
from hsdp.streams.op_table import OpKind

if TYPE_CHECKING:
    from hsdp.sharding.outer_reduce import OuterReduce

# The largest residual value kept: its square is finite in fp32. Past it every norm over
# it is inf, so a step with it is skipped or clipped to nothing, and carrying it would
# make the next steps' norms inf too.
LIMIT = torch.finfo(torch.float32).max ** 0.5


class CompressedOuter:
    """Compressed outer reduce-scatter / all-reduce of a group's ``numel``-element inner
    shard over ``n`` outer ranks; owns the residual (fp32, ``numel`` elements padded to
    whole blocks per row)."""

    def __init__(self, config: OuterReduce, numel: int, n: int, rank: int,
                 device: torch.device) -> None:
        self.config = config
        self.device = device
        self.rows = Rows(numel, n, config.block)
        self.rank = rank
        self.residual: torch.Tensor | None = None  # [n, m]; None: zeros
        self._pending: torch.Tensor | None = None  # the exposed gradients', until commit
        # set on the device while a residual is pending (read once static: make_static)
        self._flag = (torch.zeros(1, dtype=torch.int32, device=device)
                      if config.error_feedback else None)
        self._static: Pending | None = None  # the fixed pending buffer, once static

    def op_kind(self, shard_outer: bool) -> OpKind:
        """The ``OpKind`` its mode issues for the reduction (``OuterMode.reduce_op``)."""
        return self.config.reduce_op(shard_outer)

    def make_static(self) -> None:
        """From now on keep the residual in fixed buffers (module doc): the committed
        residual as it is, the pending one (a new buffer where none is pending). Host
        only, so it may run at a capture's start; needs a committed residual
        (``capture_refusal``)."""
        if self._flag is None or self._static is not None:
            return
        if self.residual is None:
            raise RuntimeError("CompressedOuter.make_static: no committed residual yet")
        rows = self._pending if self._pending is not None else torch.empty_like(self.residual)
        self._static, self._pending = Pending(rows, self._flag), None

    def capture_refusal(self) -> str | None:
        """Why a capture cannot begin now, or None: fixed buffers need a committed
        residual (an eager optimizer step with error feedback)."""
        if self._flag is not None and self._static is None and self.residual is None:
            return ("the compressed outer reduction before its first optimizer step (its "
                    "error-feedback residual is made by an eager step)")
        return None

    def _scatter(self, coll: Collectives, src: torch.Tensor, group: dist.ProcessGroup,
                 unchecked: int = -1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the ``n`` packed rows this rank received; with error feedback the quantization
        error rows, their bad blocks already the base's but in row ``unchecked``
        (``quant.Keep``), else None)."""
        feedback = self.config.error_feedback
        packed, error = encode(src, self.rows, self.config.dtype, self._base, feedback,
                               pending=self._static,
                               keep=Keep(LIMIT, unchecked) if feedback else None)
        received = torch.empty_like(packed)
        coll.all_to_all(received, packed, group, "outer")
        return received, error

    def reduce_scatter(self, coll: Collectives, out: torch.Tensor, src: torch.Tensor,
                       group: dist.ProcessGroup, avg: bool) -> None:
        """``out`` (this rank's row, ``c`` elements) = sum (``avg``: mean) over the outer
        ranks of ``src``'s rows, each quantized."""
        received, error = self._scatter(coll, src, group)
        reduced = reduce_rows(received, self.rows, self.config.dtype, avg)
        out.copy_(reduced[:out.numel()])
        self._keep(error)

    def all_reduce(self, coll: Collectives, out: torch.Tensor, src: torch.Tensor,
                   group: dist.ProcessGroup, avg: bool) -> None:
        """``out`` = sum (``avg``: mean) over the outer ranks of ``src``: the quantized
        reduce-scatter, then an all-gather of the reduced rows, quantized again."""
        received, error = self._scatter(coll, src, group, unchecked=self.rank)
        mine, dropped = reduce_requantize(received, self.rows, self.config.dtype, avg)
        gathered = torch.empty(self.rows.n, self.rows.packed, dtype=torch.uint8,
                               device=mine.device)
        coll.all_gather(gathered.view(-1), mine.view(-1), group, "outer")
        if error is not None:
            row = error[self.rank].add_(dropped, alpha=float(self.rows.n) if avg else 1.0)
            base = self._base
            keep_finite(row, None if base is None else base[self.rank], self.config.block,
                        LIMIT)
        decode_into(out, gathered, self.rows, self.config.dtype)
        self._keep(error)

    @property
    def _base(self) -> torch.Tensor | None:
        """The residual a reduction starts from: the pending one (a backward accumulating
        into gradients not yet applied), else the committed one (None: zeros); once
        static, the committed one (the device chooses: ``quant.Pending``)."""
        return self._pending if self._pending is not None else self.residual

    def _keep(self, error: torch.Tensor | None) -> None:
        """``error`` (None without error feedback) becomes the pending residual: its blocks
        with a value past ``LIMIT`` or NaN already hold the base's values (``quant.Keep``,
        in the encode pass; hsdp's own row after its second quantization's part is
        added). Once static, ``error`` is the pending buffer, the base the committed
        residual (the one before a step's backwards: a chained backward's bad block falls
        back to it, not to the previous backward's)."""
        if error is None:
            return
        self._flag.fill_(1)
        if self._static is None:
            self._pending = error

    def commit(self) -> None:
        """The optimizer applied the gradients: their residual becomes the state."""
        if self._static is not None:
            commit_pending(self.residual, self._static)
        elif self._pending is not None:
            self.residual, self._pending = self._pending, None
            self._flag.zero_()

    def drop(self) -> None:
        """The gradients were discarded before an optimizer step: back to the committed
        residual."""
        self._pending = None
        if self._flag is not None:
            self._flag.zero_()

    def residual_flat(self) -> torch.Tensor:
        """The residual over the inner shard (``numel`` fp32 elements; zeros if none)."""
        if self.residual is None:
            return torch.zeros(self.rows.numel, dtype=torch.float32, device=self.device)
        return self.rows.join(self.residual).clone()

    def load_residual(self, flat: torch.Tensor | None) -> None:
        """Set the residual from ``residual_flat``'s form (None: zeros)."""
        self.drop()
        if self._static is not None:  # the graphs' buffer: written, not replaced
            if flat is None:
                self.residual.zero_()
            else:
                self.residual.copy_(self.rows.split(flat.to(self.device, torch.float32)))
            return
        if flat is None or not self.config.error_feedback:
            self.residual = None
            return
        self.residual = self.rows.split(flat.to(self.device, torch.float32))
