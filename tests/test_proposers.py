"""One list of proposers (mesh/speculative/proposers.py, issue 56): what serving and observe read
of a proposer comes from it, and no module outside mesh/speculative/ names one."""

from __future__ import annotations

import ast
from pathlib import Path

from mesh.speculative import proposers
from mesh.speculative.plan import NgramPlan, SpecPlan
from packages.speculative import WindowPolicy

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"DRAFT", "NGRAM", "FORCED", "MTP"}
DRAFT_WINDOW = WindowPolicy(policy="fixed", initial=3, min=1, max=3)
LOOKUP = NgramPlan(1, 3, WindowPolicy(policy="cost-aware"), "test")


def test_a_plan_s_windows_are_its_proposers_with_their_policies() -> None:
    draft = SpecPlan("draft.gguf", DRAFT_WINDOW, "test", None)
    lookup_alone = SpecPlan(None, LOOKUP.window, "test", None, ngram=LOOKUP)
    both = SpecPlan("draft.gguf", DRAFT_WINDOW, "test", None, ngram=LOOKUP)
    assert proposers.windows(draft) == {"draft": DRAFT_WINDOW}
    assert proposers.windows(lookup_alone) == {"ngram": LOOKUP.window}
    assert proposers.windows(both) == {"draft": DRAFT_WINDOW, "ngram": LOOKUP.window}
    mtp = SpecPlan(None, DRAFT_WINDOW, "test", None, ngram=LOOKUP, mtp=DRAFT_WINDOW, mtp_layers=1)
    assert proposers.windows(mtp) == {"mtp": DRAFT_WINDOW, "ngram": LOOKUP.window}


def test_forced_tokens_are_a_proposer_no_window_controller_sizes() -> None:
    assert proposers.counted() == ("draft", "mtp", "ngram")
    assert not proposers.windowed("forced")
    assert proposers.windowed("draft")
    assert not proposers.windowed("no such proposer")


def test_no_module_outside_the_speculative_part_imports_a_proposer_s_name() -> None:
    found = []
    for path in (ROOT / "mesh").rglob("*.py"):
        if path.parent == ROOT / "mesh" / "speculative":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mesh.speculative"):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name in NAMES]
    assert found == []
