"""The generate loop at stage 0, with or without a draft (DESIGN.md §6).

Each round the draft proposes k tokens; stage 0 sends [last, d1..dk] through the pipeline
as one VERIFY pass; the final stage samples the target's token at every position; the
longest prefix where draft == target is accepted, plus the target's own next token. The
next frame starts at the accepted position, which trims every stage's KV (and the draft's).
With k = 0 a round is a plain decode step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from mesh.backend import Acceptance, Finished, GenerationEvent, GenerationRequest
from mesh.pipeline import Pipeline
from mesh.speculative.draft import Draft, common_prefix
from mesh.speculative.window import Controller
from proto import meshpipe_pb2 as pb


async def generate(pipeline: Pipeline, session: int, lane: int, req: GenerationRequest, ctx: int,
                   draft: Draft | None = None, window: Controller | None = None) -> AsyncIterator[GenerationEvent]:
    """The events of one generation, as `Backend.generate` documents them."""
    stops = set() if req.ignore_eos else set(req.stop_tokens)
    tokens = list(req.prompt)
    pending = await pipeline.run(session, lane, 0, tokens, req.sampling, kind=pb.PREFILL)
    acceptance = Acceptance() if draft is not None else None
    if acceptance is not None:
        yield acceptance  # with a draft, every token comes after a record that counts its window
    completion = 0
    while True:
        for sampled in pending:
            if sampled.token in stops:
                yield Finished("stop", len(req.prompt), completion, acceptance)
                return
            completion += 1
            tokens.append(sampled.token)
            yield sampled  # with the target's numbers for this position: its verify row drew it
            if completion >= req.max_tokens:
                yield Finished("length", len(req.prompt), completion, acceptance)
                return
        # the last token is not in any KV yet; room bounds the window by context and budget
        room = min(ctx - len(tokens), req.max_tokens - completion) - 1
        k = max(0, min(window.next_window() if window else 0, room))
        drafts = await draft.propose(lane, tokens, k) if draft and k else []
        sent = time.perf_counter()
        # the penalties count the completion only, so the history starts after the prompt
        history = tokens[len(req.prompt):] if req.sampling.penalised else ()
        target = await pipeline.run(session, lane, len(tokens) - 1, [tokens[-1], *drafts], req.sampling,
                                    all_logits=bool(drafts), kind=pb.VERIFY if drafts else pb.DECODE,
                                    history=history)
        n = common_prefix(drafts, [s.token for s in target])
        if window is not None:
            draft_s = draft.step_seconds * k if draft else 0.0
            window.record(k, n, draft_s, time.perf_counter() - sent)
        if acceptance is not None and k:
            acceptance = acceptance.add(k, n)
            yield acceptance  # before the tokens this window produced
        pending = target[: n + 1]
