"""The stage core: one layer range of the model, run for many sessions (DESIGN.md §2, §3).

Stage 0 (`mesh/serving/pipeline.py` `Pipeline`) and every `mesh stage` (`stage/activations.py`
`ActivationStage`) are built on it; they differ only in where frames come from and go to.
The core owns the engine's batcher and the session → lane map, turns a frame's payload
into engine input and engine output into wire bytes, answers a frame at the final stage
(`answer`: sampled tokens or an ERROR, wherever that stage runs), and stamps each step's
timings as a Hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from common.ids import LaneId, SessionId
from common.sampling import Sampled
from config.errors import MeshpipeError
from proto import meshpipe_pb2 as pb
from stage.batcher import Batcher, StepClock
from stage.engine import RangeEngine, Step
from stage.frames import FrameSampling, error_frame, input_rows, reply_frame
from stage.lane_tier import Begin, LaneTier
from stage.lanes import LanePool
from stage.rejection import Tail, verify_frame
from stage.sampling import sample_rows, score_rows
from stage.transport import decode_tensor, encode_tensor


class CannotSampleError(MeshpipeError):
    """The final stage's logits could not be sampled (the request fails, the stage goes on)."""


@dataclass
class Work:
    """A step on its way through the core: its output, and the time it has taken so far."""

    output: asyncio.Future[np.ndarray]
    clock: StepClock = field(default_factory=StepClock)
    codec_s: float = 0.0  # decoding the input frame; encoding the output adds to it


@dataclass(frozen=True)
class Encoded:
    """A step's output as wire bytes, and the hop that made it."""

    dtype: int
    shape: tuple[int, ...]
    data: bytes
    hop: pb.Hop

    def describe(self, header: pb.FrameHeader) -> None:
        """Write the payload's dtype, shape and size into the frame that carries it."""
        header.dtype = self.dtype  # type: ignore[assignment]
        del header.shape[:]
        header.shape.extend(self.shape)
        header.payload_bytes = len(self.data)


class StageCore:
    def __init__(self, engine: RangeEngine, index: int, wire_dtype: int = pb.F32, micro_batches: int = 1,
                 shared: Batcher | None = None, lanes: LanePool | None = None) -> None:
        """`shared`: the batcher of an engine several claims run on (stage/hosted.py), which
        this core neither starts nor stops; `lanes`: the engine lanes this core's claim holds."""
        self.engine = engine
        self.index = index  # this stage's place in the route, stamped on its hops
        self.wire_dtype = wire_dtype
        self.owns_batcher = shared is None
        self.batcher = shared if shared is not None else Batcher(engine)
        self.lanes = lanes if lanes is not None else LanePool(engine.lanes)  # an empty pool is falsy
        self.micro_batches = micro_batches
        if micro_batches > 1:
            self.batcher.max_steps = self.group_size
        # frames in flight (DESIGN.md §6): each session's newest epoch
        self.epochs: dict[SessionId, int] = {}
        self.skipped = 0  # frames of a void epoch dropped before they ran
        # rejection sampling: each session's newest sampled row, which the next frame's first
        # token is checked against when that token is a draft (stage/rejection.py)
        self.tails: dict[SessionId, Tail] = {}
        # the stage's KV tier, for this claim's lanes (stage/lane_tier.py); set by whoever builds
        # the core, where the stage keeps one
        self.tier: LaneTier | None = None

    def start(self) -> None:
        if self.owns_batcher:
            self.batcher.start()

    async def stop(self) -> None:
        if self.tier is not None and not self.batcher.stopped:  # free lanes' sequences outlive the stage
            with contextlib.suppress(Exception):
                await self.batcher.control(self.tier.flush)
        if self.owns_batcher:
            await self.batcher.stop()

    # -- lanes ---------------------------------------------------------------------------

    def lane_for(self, session: SessionId, prefer: LaneId | None = None) -> LaneId:
        """The session's KV lane, taken on first sight (`prefer` if free); raises LanesExhaustedError."""
        return self.lanes.lane_for(session, prefer)

    def release(self, session: SessionId, keep: int = 0, stash: str = "") -> asyncio.Future[np.ndarray] | None:
        """Free the session's lane, its KV cut to the first `keep` positions (the prefix cache
        keeps those for a later request, filed under `stash` in the KV tier should the lane be
        taken for another sequence); the future resolves once it is cut (None: no lane)."""
        if not 0 <= keep <= self.engine.ctx_per_lane:  # it may come from the network
            raise ValueError(f"keep {keep} is outside the lane's context of {self.engine.ctx_per_lane}")
        lane = self.lanes.release(session)
        self.epochs.pop(session, None)
        self.tails.pop(session, None)
        if lane is None:
            return None
        self.skipped += self.batcher.discard_lane(lane)
        trim = self.batcher.trim(lane, keep)
        if self.tier is not None:
            self.batcher.control(functools.partial(self.tier.ended, lane, stash, keep)).add_done_callback(_retrieved)
        return trim

    async def release_all(self) -> None:
        for session in list(self.lanes.by_session):
            trim = self.release(session)
            if trim is not None:
                with contextlib.suppress(Exception):
                    await trim

    def group_size(self) -> int:
        """Steps per decode with micro-batches (DESIGN.md §3): the open sessions split into
        `micro_batches` groups, so while one group is downstream the next is computed here."""
        return max(1, math.ceil(len(self.lanes) / self.micro_batches))

    # -- steps ---------------------------------------------------------------------------

    def submit(self, step: Step) -> Work:
        """Queue a step on its lane (stage 0, which has the lane already)."""
        clock = StepClock()
        return Work(self.batcher.submit(step, clock), clock)

    def is_void(self, header: pb.FrameHeader) -> bool:
        """Whether a frame's epoch is older than the newest its session has sent here."""
        return header.epoch < self.epochs.get(SessionId(header.session_id), 0)

    def submit_frame(self, header: pb.FrameHeader, payload: bytes) -> Work:
        """Queue a compute frame from upstream; raises LanesExhaustedError, or ValueError for a
        lane this session cannot have. A frame of a newer
        epoch drops the session's queued frames of older ones first: they are void."""
        clock = StepClock()  # from arrival: decoding the payload counts as queueing too
        session = SessionId(header.session_id)
        newer = header.epoch > self.epochs.get(session, 0)
        if newer:
            self.epochs[session] = header.epoch
        # the wire names sessions and the lane stage 0 chose for each: all stages use the same
        named = header.HasField("lane")
        new = session not in self.lanes.by_session
        lane = self.lanes.take(session, LaneId(header.lane)) if named else self.lanes.lane_for(session)
        if new:
            begin_lane(self, lane, Begin(header.evict, header.restore, header.restore_positions, header.restore_keep))
        if newer:  # frames come in order, so every step the session has queued is of an older epoch
            self.skipped += self.batcher.discard_lane(lane)
        if self.engine.first:
            # layer 0 is remote only when a Load asks for layer_start 0 (the coordinator's routes never do)
            tokens = np.asarray(header.tokens, dtype=np.int32)
            step = Step(lane, header.start_pos, tokens=tokens, all_logits=header.all_logits)
        else:
            hidden = decode_tensor(header, payload)
            fed = np.asarray(header.fed, dtype=np.int32) if header.fed else None  # the MTP layer's tokens
            step = Step(lane, header.start_pos, hidden=hidden, all_logits=header.all_logits, fed=fed)
        codec_s = time.perf_counter() - clock.queued
        return Work(self.batcher.submit(step, clock), clock, codec_s)

    def sampling_problem(self, header: pb.FrameHeader, sampling: FrameSampling) -> str | None:
        """Sampling arrives from the network (`sampling`, read off `header`): check it
        before it reaches the sampler."""
        rows = input_rows(header) if header.all_logits else 1
        if sampling.targets and not header.all_logits:
            return f"stage {self.index}: a frame that scores rows must compute all of them (all_logits)"
        problem = sampling.problem(self.engine.n_vocab, self.engine.ctx_per_lane, rows)
        return None if problem is None else f"stage {self.index}: {problem}"

    # -- outputs -------------------------------------------------------------------------

    def encode(self, work: Work, hidden: np.ndarray) -> Encoded:
        """A non-final stage's output, packed for the next stage."""
        encoding = time.perf_counter()
        shape, data = encode_tensor(hidden, self.wire_dtype)
        hop = self._hop(work, codec_s=time.perf_counter() - encoding)
        return Encoded(self.wire_dtype, tuple(shape), data, hop)

    def sample(self, work: Work, logits: np.ndarray, frame: FrameSampling, start: int,
               rows: int, session: SessionId | None = None) -> tuple[list[Sampled], pb.Hop]:
        """The final stage's tokens for a step of `rows` input rows fed at `start`: the scored
        rows' first, then those sampled, by rejection sampling where the frame asks, against
        `session`'s last row."""
        sampling = time.perf_counter()
        try:
            scored = score_rows(logits[: frame.scored], frame.targets, frame.params) if frame.scored else []
            logits = logits[frame.scored :]
            picks: list[Sampled] = []
            if not len(logits):
                pass  # an earlier chunk of a scored prompt: its last row's next token is the next chunk's
            elif frame.params.rejects and session is not None:
                picks, self.tails[session] = verify_frame(logits, frame, start, rows, self.tails.get(session))
            else:
                picks = sample_rows(logits, frame.params, start, rows, frame.history, frame.drafts, frame.masks)
        except ValueError as exc:  # finite but extreme values can still overflow to NaN probabilities
            raise CannotSampleError(f"stage {self.index}: cannot sample: {exc}") from None
        return scored + picks, self._hop(work, sample_s=time.perf_counter() - sampling)

    def answer(self, h: pb.FrameHeader, work: Work, logits: np.ndarray, frame: FrameSampling,
               rows: int) -> pb.FrameHeader:
        """The final stage's answer to frame `h`, which fed `rows` input rows: a REPLY with
        its sampled tokens, or an ERROR when they cannot be sampled (the request fails, the
        stage and the route serve on). Stage 0 alone answers its own frames the same way."""
        try:
            picks, hop = self.sample(work, logits, frame, h.start_pos, rows, SessionId(h.session_id))
        except CannotSampleError as exc:
            return error_frame(h, str(exc))
        return reply_frame(h, picks, hop)

    def _hop(self, work: Work, codec_s: float = 0.0, sample_s: float = 0.0) -> pb.Hop:
        """The timings this stage stamps on a step it ran; `codec_s` adds to the decoding."""
        clock = work.clock
        return pb.Hop(stage_index=self.index, queue_us=int(clock.queue_s * 1e6),
                      compute_us=int(clock.compute_s * 1e6), codec_us=int((work.codec_s + codec_s) * 1e6),
                      sample_us=int(sample_s * 1e6), batch_rows=clock.rows)


def begin_lane(core: StageCore, lane: LaneId, begin: Begin) -> None:
    """A request takes `lane`: with a KV tier, what the lane held is filed there or kept as the
    request's own prefix, and an entry the request extends is loaded, before its first step
    runs (queued ahead of it). A failure there shows as the step's (the lane is left empty)."""
    if core.tier is not None:
        core.batcher.control(functools.partial(core.tier.begin, lane, begin)).add_done_callback(_retrieved)


def _retrieved(future: asyncio.Future[np.ndarray]) -> None:
    if not future.cancelled():
        future.exception()
