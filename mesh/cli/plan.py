"""`mesh plan`: where a model would be cut across machines, and whether it fits, from its
GGUF header alone (mesh/routing/header_plan.py): nothing of the weights is fetched."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from config.settings import UsageError
from mesh.routing.header_plan import ModelPlan, PlanAsk, StagePlan, plan_model
from packages.gguf_infos import GGUFInfo, read_header, read_package_header, read_remote_header
from packages.manifest import MANIFEST_NAME
from packages.refs import HubRef, is_hub_ref, parse_draft_ref
from stage.engine_choice import ENGINES, LLAMA, engine_kind

# G and GiB are 2^30 bytes, GB is 10^9: a machine sold as "512 GB" has 512 GiB of memory, and
# free(1) and llama.cpp print G for GiB; a disk-like GB is said with its B.
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?B)?)?", re.IGNORECASE)
_POWER = {"K": 1, "M": 2, "G": 3, "T": 4}
UNITS_HELP = "K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB powers of 1000; bare: bytes"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan a model across machines from its GGUF header, before fetching it")
    p.add_argument("--model", required=True, metavar="REF",
                   help="a GGUF file (the first shard of a split one), hf://org/repo[@rev]/file.gguf (only "
                   "its header is read, by HTTP range), or a layer package directory")
    p.add_argument("--machine", required=True, action="append", type=memory_size, metavar="SIZE",
                   help=f"memory a machine gives its stage, as 512G or 192GiB; once per machine, stage 0 "
                   f"first ({UNITS_HELP})")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions (KV lanes), as mesh serve")
    p.add_argument("--ctx-size", type=int, default=2048, help="context tokens per session, as mesh serve")
    p.add_argument("--engine", choices=sorted(ENGINES), default=LLAMA.name, help="the range engine counted")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)


def memory_size(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512G, 192GiB or 64GB, got {text!r}")
    number, prefix, unit = match.groups()
    base = 1000 if unit is not None and unit.lower() == "b" else 1024
    size = int(float(number) * base ** _POWER[prefix.upper()]) if prefix else int(float(number))
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a machine's memory must be positive, got {text!r}")
    return size


def _plan(args: argparse.Namespace) -> int:
    if args.lanes < 1 or args.ctx_size < 1:
        raise UsageError("--lanes and --ctx-size must be at least 1")
    info = read_model_header(args.model)
    plan = plan_model(info, PlanAsk(tuple(args.machine), args.lanes, args.ctx_size, engine_kind(args.engine)))
    print(json.dumps({"model": args.model, **dataclasses.asdict(plan)}, indent=2) if args.json
          else format_plan(args.model, plan))
    return 0 if plan.fits else 1


def read_model_header(ref: str) -> GGUFInfo:
    if is_hub_ref(ref):
        parsed = parse_draft_ref(ref) if ref.lower().endswith(".gguf") else None
        if not isinstance(parsed, HubRef) or parsed.path is None:
            raise UsageError(f"--model {ref}: mesh plan reads a GGUF's header; name the file, "
                             "hf://org/repo[@rev]/file.gguf")
        from packages.hub_range import range_reader  # the Hub client only when a Hub file is asked for

        repo = parsed.package()
        return read_remote_header(parsed.path, lambda name: range_reader(HubRef(repo.repo_id, repo.revision, name)))
    path = Path(ref).expanduser()
    return read_package_header(path) if (path / MANIFEST_NAME).is_file() else read_header(path)


def format_plan(model: str, plan: ModelPlan) -> str:
    dropped = f" (+{plan.dropped_layers} MTP dropped)" if plan.dropped_layers else ""
    moe = f", experts {plan.experts_used} of {plan.experts_total} a token" if plan.experts_total else ""
    lines = [f"model:      {model} ({plan.architecture}, {plan.layers} layers{dropped}; "
             f"header {_size(plan.header_bytes)} read)",
             f"splits:     {'yes' if plan.splits else 'no'} — {plan.split_rule}",
             f"parameters: {plan.parameters / 1e9:.1f}B total, {plan.active / 1e9:.1f}B active{moe}",
             f"context:    {plan.lanes} lanes x {plan.ctx} tokens on {plan.engine}"]
    if plan.serves is not None:
        lines.append(f"serves:     no — {plan.serves}")
    lines += ["", *_table([_HEAD, *(_row(i, s) for i, s in enumerate(plan.stages))]), ""]
    lines.append("fits:       yes" if plan.fits else "fits:       no — " + "; ".join(_short(plan)))
    return "\n".join(lines)


_HEAD = ("stage", "machine", "layers", "weights", "KV/lane", "state/lane", "needs", "params (active)")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _row(index: int, s: StagePlan) -> tuple[str, ...]:
    return (str(index), f"{s.machine}: {_size(s.memory)}", f"[{s.start},{s.end})", _size(s.weights),
            _size(s.kv_per_lane), _size(s.state_per_lane), _size(s.total),
            f"{s.parameters / 1e9:.1f}B ({s.active / 1e9:.1f}B)")


def _short(plan: ModelPlan) -> list[str]:
    """Which machine is short and by how much, then the fit check's own words."""
    short = [f"machine {s.machine} ({_size(s.memory)}) is {_size(s.short)} short for layers [{s.start},{s.end})"
             for s in plan.stages if s.short]
    return short + list(plan.problems)


def _size(n: int) -> str:
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << power:
            return f"{n / (1 << power):.1f} {unit}"
    return f"{n} B"
