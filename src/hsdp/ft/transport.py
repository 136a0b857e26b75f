"""How a recovering replica group receives a live one's state: over the job's own process
group (torchft's managed one), loaded without unpickling code, checked by a SHA-256 digest,
and agreed on by every rank of the recovering group before anything is applied.

**WHY not torchft's HTTP transport** (its default): it serves the state on every interface
without authentication and the receiver unpickles what it gets, so whoever reaches the port
runs code in the job. **WHY an agreement**: torchft applies what each rank received on its
own; when a sender dies mid-transfer, some ranks of the group would hold the live state and
others their old one, and commit steps on that mixed model. It imports nothing of hsdp but
the error (``sharding`` never sees it; ``ft/outer.py`` installs it).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hsdp.ft.errors import FaultToleranceError

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # a device copy of at most this much is alive while sending
_HEADER = 2 + 32  # step, payload bytes, the SHA-256 digest (one int64 per byte)


class _Refused(Exception):
    """The live group's state holds what ``torch.load(weights_only=True)`` refuses."""


def _refusal(exc: pickle.UnpicklingError) -> str:
    """Why ``weights_only`` refused the state, naming the type and the ways out."""
    named = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
    what = named.group(1) if named else "an object"
    detail = "" if named else f" ({str(exc).strip().splitlines()[-1]})"
    allow = named.group(1) if named else "<the type>"
    return (f"the live group's state holds {what}{detail}, which torch.load(weights_only="
            f"True) does not load (tensors, numbers, strings and containers only: no peer's "
            f"code runs here), so no retry can succeed and this group stops. Keep what "
            f"recovery sends (optimizer param_groups and state, the LR scheduler's "
            f"state_dict, functions registered with the Manager) to those types (e.g. "
            f"float(lr), not a numpy scalar), or, if you trust every replica group, allow "
            f"it on every rank with torch.serialization.add_safe_globals([{allow}])")


class RecoveryTransport:
    """torchft's ``CheckpointTransport`` interface over torchft's managed process group
    ``pg``: rank ``i`` of a live group sends its state to rank ``i`` of a recovering one
    (``torch.save`` bytes, in chunks of ``CHUNK_BYTES`` on ``device_type``, after a header
    with the step, the size and the bytes' SHA-256), the receiver checks the digest and
    loads with ``weights_only=True`` (tensors and plain containers only, no code).

    Before ``recv_checkpoint`` returns, every rank of the recovering group posts what it
    received (step, source, digest, or its error) to the group's store and waits for all
    the others: unless every rank received the same step intact, every rank raises
    ``FaultToleranceError``, so torchft applies nothing, commits nothing, and retries the
    recovery at the next quorum. ``check_progress`` then refuses to train on from an older
    step than the one a failed recovery was to bring (every live group was lost during the
    transfer), unless ``allow_lost_progress``; ``expect`` learns that step from each
    quorum. A state that ``weights_only`` refuses on any rank can never be received:
    ``unrecoverable`` then says why, and the group gives up (``ElasticOuter.size``)
    instead of retrying at every quorum, which would fail the live groups' steps too.
    ``bind`` gives it the group's store and names each attempt (``init_mesh`` does
    both)."""

    def __init__(self, pg: Any, device_type: str = "cpu",
                 allow_lost_progress: bool = False) -> None:
        self._pg = pg  # torchft gives each transfer its timeout (the Manager's)
        self._device = torch.device(device_type)
        self.allow_lost_progress = allow_lost_progress
        self.awaited_step: int | None = None  # the newest step a recovery was to bring
        self._heal_step: int | None = None  # this quorum's step, until this rank posts
        self._failed_early: tuple[str, int] | None = None  # (attempt, step) posted failed
        self.unrecoverable: str | None = None  # why no recovery can succeed, once known
        self._store: Any = None
        self._attempt: Callable[[], str] | None = None
        self._rank, self._world = 0, 1

    def bind(self, attempt: Callable[[], str], store: Any | None = None,
             rank: int | None = None, world: int | None = None) -> None:
        """Where the recovering group's ranks meet: ``store`` (default: the torch world's,
        which is the replica group), this rank and the group's size (default: the world's),
        under the key ``attempt()``, which names the recovery attempt, the same on the
        group's ranks and new at each retry (else a retry would read the last attempt's
        outcomes)."""
        self._attempt = attempt
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._rank = dist.get_rank() if rank is None else rank
        self._world = dist.get_world_size() if world is None else world

    def metadata(self) -> str:
        return "hsdp"  # the peer is found by its replica rank in ``pg``: nothing to look up

    def disallow_checkpoint(self) -> None:
        pass  # send_checkpoint returns once everything was sent

    def shutdown(self, wait: bool = True) -> None:
        pass

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        """Send ``state_dict`` (torchft's ``{"user": ..., "torchft": ...}``) at ``step`` to
        each of ``dst_ranks`` (replica ranks in ``pg``)."""
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        payload = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        digest = hashlib.sha256(buf.getbuffer()).digest()
        header = torch.tensor([step, payload.numel(), *digest], dtype=torch.int64)
        self._each(dst_ranks, header, 1, timeout)
        for i, start in enumerate(range(0, payload.numel(), CHUNK_BYTES)):
            self._each(dst_ranks, payload[start:start + CHUNK_BYTES], 2 + i, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        """The state ``src_rank`` sends at ``step``, once every rank of this group has
        received the same step intact; else ``FaultToleranceError`` on every rank."""
        if self._failed_early == (self._key(), step):  # already posted: no second outcome
            state, mine = None, None
        else:
            try:
                state, digest = self._receive(src_rank, step, timeout)
                mine = {"ok": True, "step": step, "src": src_rank, "digest": digest}
            except _Refused as exc:  # the same state at every retry: give up
                state, mine = None, {"ok": False, "error": str(exc), "refused": True}
            except Exception as exc:  # posted, then raised on every rank by the agreement
                state, mine = None, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        outcomes = self._agree(mine, step, timeout)
        refused = [o["error"] for o in outcomes if o.get("refused")]
        if refused:
            self.unrecoverable = (f"hsdp: this replica group cannot recover step {step} "
                                  f"from replica rank {src_rank}: {refused[0]}")
            raise FaultToleranceError(self.unrecoverable)
        failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if not o["ok"]]
        received = {(o["step"], o["src"]) for o in outcomes if o["ok"]}
        if not failed and len(received) > 1:
            failed = [f"the ranks received different (step, source) {sorted(received)}"]
        if failed:
            raise FaultToleranceError(
                f"hsdp: recovering step {step} from replica rank {src_rank} failed on "
                f"{len(failed)} of this group's {self._world} ranks ({'; '.join(failed)}); "
                f"no rank applies anything (torchft retries at the next quorum)")
        log.info("hsdp: received step %d from replica rank %d, sha256 %s (every rank of "
                 "the group received it)", step, src_rank, mine["digest"])
        return state

    def expect(self, step: int) -> None:
        """A quorum asks this group to recover ``step`` (before any of the transfer)."""
        self.awaited_step = max(step, self.awaited_step or step)
        self._heal_step = step

    def fail_early(self, exc: BaseException) -> None:
        """torchft's recovery failed on this rank before ``recv_checkpoint`` (e.g. asking a
        dead sender for its metadata): post the failure for this quorum's attempt, so that
        the group's other ranks, waiting in ``recv_checkpoint``, fail now with it rather
        than after twice the timeout (by which time this rank's commit vote would have
        timed out waiting for them)."""
        step, self._heal_step = self._heal_step, None
        if step is None or self._attempt is None:
            return  # no recovery pending on this rank: nothing to tell
        self._failed_early = (self._key(), step)
        error = f"{type(exc).__name__}: {exc} (before the transfer)"
        self._store.set(f"{self._prefix(step)}{self._rank}",
                        json.dumps({"ok": False, "error": error}))

    def check_progress(self, step: int) -> None:
        """Before this group trains at ``step`` (taking part, not recovering): refuse if a
        failed recovery was to bring a newer step, which no live group holds any more."""
        awaited = self.awaited_step
        if awaited is None or step >= awaited:
            return
        lost = (f"this replica group was to recover step {awaited} from a live group, which "
                f"was lost during the transfer; no replica group holds it any more, and "
                f"training on from step {step} with this group's own state drops "
                f"{awaited - step} step(s) of progress")
        if not self.allow_lost_progress:
            raise FaultToleranceError(
                f"hsdp: {lost}. Restart from a checkpoint (hsdp.load), or pass "
                f"hsdp.FaultTolerance(allow_lost_progress=True) to train on from step {step}")
        log.warning("hsdp: %s (allow_lost_progress=True)", lost)
        self.awaited_step = None

    def _each(self, ranks: list[int], t: torch.Tensor, tag: int, timeout: timedelta,
              receive: bool = False) -> None:
        """Send ``t`` to each of ``ranks`` (``receive``: into ``t`` from the one rank),
        waited for, through a device copy of ``t`` (one chunk alive at a time) unless
        ``t`` is on the device already."""
        dev = t.to(self._device)
        op = self._pg.recv if receive else self._pg.send
        for work in [op([dev], r, tag) for r in ranks]:
            work.wait(timeout)
        if receive and dev is not t:
            t.copy_(dev)

    def _receive(self, src_rank: int, step: int, timeout: timedelta) -> tuple[Any, str]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        self._each([src_rank], header, 1, timeout, receive=True)
        sent_step, size = int(header[0]), int(header[1])
        if sent_step != step:
            raise FaultToleranceError(f"replica rank {src_rank} sent step {sent_step}, "
                                      f"not {step}")
        payload = torch.empty(size, dtype=torch.uint8)
        for i, start in enumerate(range(0, size, CHUNK_BYTES)):
            self._each([src_rank], payload[start:start + CHUNK_BYTES], 2 + i, timeout,
                       receive=True)
        data = payload.numpy().tobytes()
        digest = hashlib.sha256(data)
        if digest.digest() != bytes(header[2:].tolist()):
            raise FaultToleranceError(f"the state from replica rank {src_rank} does not "
                                      f"match its SHA-256 digest")
        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location=self._place)
        except pickle.UnpicklingError as exc:  # torch's weights_only refusal
            raise _Refused(_refusal(exc)) from exc
        return state, digest.hexdigest()

    def _place(self, storage: Any, location: str) -> Any:
        """``torch.load``'s placement: CPU tensors stay on CPU, device ones go to this
        rank's device (the sender's index may not exist here)."""
        return storage if location == "cpu" else storage.to(device=self._device)

    def _key(self) -> str:
        assert self._attempt is not None
        return str(self._attempt())

    def _prefix(self, step: int) -> str:
        return f"hsdp/ft/recovery/{self._key()}/{step}/"

    def _agree(self, mine: dict | None, step: int, timeout: timedelta) -> list[dict]:
        """Every rank's outcome of receiving ``step`` (``mine`` for this one; None: posted
        already by ``fail_early``), through the group's store; a rank that posts nothing
        within twice the timeout (its own transfer's bound) failed."""
        if self._attempt is None:
            raise FaultToleranceError("hsdp: RecoveryTransport used before bind(); pass "
                                      "it to init_mesh through its torchft Manager")
        self._heal_step = None
        prefix = self._prefix(step)
        if mine is not None:
            self._store.set(f"{prefix}{self._rank}", json.dumps(mine))
        keys = [f"{prefix}{r}" for r in range(self._world)]
        try:
            self._store.wait(keys, timeout * 2)
        except Exception:  # DistStoreError: one or more ranks never posted
            pass
        return [json.loads(self._store.get(k)) if self._store.check([k]) else
                {"ok": False, "error": f"posted nothing within {2 * timeout.total_seconds():g} s"}
                for k in keys]
