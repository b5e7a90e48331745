"""Package and draft refs: parsing (property tests), quant selection, and draft resolution offline."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hub_cache import COMMIT, add_files, cache_package, use_hf_home
from hypothesis import given
from hypothesis import strategies as st

from packages import hub
from packages.errors import PackageError
from packages.refs import HubRef, QuantRef, parse_draft_ref, parse_hub_ref, parse_package_ref

_ALNUM = string.ascii_letters + string.digits
_NAME_CHARS = _ALNUM + "-_."


@st.composite
def names(draw: st.DrawFn) -> str:
    """Hub namespace and repo names: alphanumeric ends, no `--` or `..`, not ending in .git."""
    middle = draw(st.text(_NAME_CHARS, max_size=12))
    name = draw(st.sampled_from(_ALNUM)) + middle + draw(st.sampled_from(_ALNUM))
    if "--" in name or ".." in name or name.endswith(".git"):
        name = draw(st.sampled_from(_ALNUM)) * 3
    return name


_segment = st.text(_ALNUM + "-_", min_size=1, max_size=8)
branches = st.lists(_segment, min_size=1, max_size=3).map("/".join)
commits = st.text("0123456789abcdef", min_size=40, max_size=40)
revisions = st.one_of(st.none(), branches, commits)
file_paths = st.lists(_segment, min_size=0, max_size=2).map(lambda parts: "/".join([*parts, "draft.gguf"]))


@given(names(), names(), revisions)
def test_package_refs_round_trip(org, name, rev):
    ref = HubRef(f"{org}/{name}", rev)
    assert parse_package_ref(str(ref)) == ref
    if rev is not None:
        assert parse_package_ref(f"hf://{org}/{name}:{rev}") == ref  # `:rev` means `@rev`
    assert ref.pinned == (rev is not None and len(rev) == 40 and all(c in "0123456789abcdef" for c in rev))


@given(names(), names(), revisions, file_paths)
def test_draft_file_refs_round_trip(org, name, rev, path):
    ref = HubRef(f"{org}/{name}", rev, path)
    text = str(ref)
    assert parse_draft_ref(text) == ref  # a `/` inside rev travels as %2F
    assert ref.package() == HubRef(f"{org}/{name}", rev)


@given(names(), names(), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_]{0,9}", fullmatch=True))
def test_quant_refs(org, name, quant):
    assert parse_draft_ref(f"{org}/{name}:{quant}") == QuantRef(f"{org}/{name}", quant)


@given(st.text(max_size=40))
def test_any_text_parses_or_fails_with_a_package_error(text):
    for parse in (parse_package_ref, parse_draft_ref):
        for candidate in (text, "hf://" + text):
            try:
                parse(candidate)
                continue
            except PackageError as exc:
                message = str(exc)
            assert "\n" not in message


@given(st.text(string.ascii_letters + "/._-", min_size=1, max_size=30).filter(lambda t: not t.startswith("hf://")))
def test_anything_without_the_scheme_is_a_local_path(text):
    assert parse_package_ref(text) == Path(text).expanduser()


@pytest.mark.parametrize("bad", [
    "hf://org", "hf://org/name/extra", "hf://org/na--me", "hf://-org/name", "hf://org/name@",
    "hf://org/name@a..b", "hf://org/name@/x", "hf://org/name@x/", "hf:// org/name", "hf://a/b/c@main",
])
def test_bad_package_refs_are_clear_errors(bad):
    with pytest.raises(PackageError, match=r"bad|expected"):
        parse_package_ref(bad)


@pytest.mark.parametrize("bad", ["hf://org/repo", "hf://org/repo@main", "hf://org/repo@v1/../x.gguf",
                                 "org/repo", "org:Q4", "just-a-name"])
def test_bad_draft_refs_are_clear_errors(bad):
    with pytest.raises(PackageError, match=r"bad draft ref|bad repo id|bad file path"):
        parse_draft_ref(bad)


def test_draft_ref_forms():
    assert parse_draft_ref("org/repo:Q4_K_M") == QuantRef("org/repo", "Q4_K_M")
    assert parse_draft_ref("drafts/small.gguf") == Path("drafts/small.gguf")
    assert parse_draft_ref("hf://org/repo@v2/sub/small.gguf") == HubRef("org/repo", "v2", "sub/small.gguf")
    assert parse_draft_ref("hf://org/repo/small.gguf") == HubRef("org/repo", None, "small.gguf")
    pr = parse_draft_ref("hf://org/repo@refs%2Fpr%2F3/x.gguf")
    assert isinstance(pr, HubRef)
    assert pr.revision == "refs/pr/3"


def test_parse_hub_ref_refuses_local_paths():
    with pytest.raises(PackageError, match="not a Hub ref"):
        parse_hub_ref("/some/dir")


# -- quant selection ------------------------------------------------------------------------------------

FILES = ["README.md", "SmolLM2-135M.Q4_K_M.gguf", "SmolLM2-135M.Q4_K_S.gguf", "SmolLM2-135M.Q8_0.gguf",
         "SmolLM2-135M.Q4_0.gguf", "SmolLM2-135M.Q4_0_4_4.gguf", "sub/SmolLM2-135M-f16.gguf"]


@pytest.mark.parametrize(("quant", "picked"), [
    ("Q8_0", "SmolLM2-135M.Q8_0.gguf"),
    ("q4_k_m", "SmolLM2-135M.Q4_K_M.gguf"),  # case-insensitive
    ("Q4_0", "SmolLM2-135M.Q4_0.gguf"),  # an exact token beats the longer Q4_0_4_4
    ("F16", "sub/SmolLM2-135M-f16.gguf"),
])
def test_quant_picks_the_one_matching_gguf(quant, picked):
    assert hub.pick_quant(FILES, quant, "org/repo") == picked


def test_ambiguous_quant_lists_the_candidates():
    with pytest.raises(PackageError, match="ambiguous") as err:
        hub.pick_quant(FILES, "Q4_K", "org/repo:Q4_K")
    assert "SmolLM2-135M.Q4_K_M.gguf" in str(err.value)
    assert "SmolLM2-135M.Q4_K_S.gguf" in str(err.value)


def test_missing_quant_lists_the_ggufs():
    with pytest.raises(PackageError, match="no GGUF named with quant Q2_K") as err:
        hub.pick_quant(FILES, "Q2_K", "org/repo:Q2_K")
    assert "SmolLM2-135M.Q8_0.gguf" in str(err.value)
    assert "README.md" not in str(err.value)
    with pytest.raises(PackageError, match="GGUF files: none"):
        hub.pick_quant(["README.md"], "Q8_0", "org/repo:Q8_0")


# -- draft resolution against an HF cache, offline -------------------------------------------------------


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    return use_hf_home(tmp_path / "hf", monkeypatch, offline=True)


def test_quant_draft_resolves_from_the_cache(hf_offline):
    add_files(hf_offline, "org/drafts", COMMIT, {"d.Q8_0.gguf": b"eight", "d.Q4_K_M.gguf": b"four"})
    path = hub.resolve_draft("org/drafts:q8_0", Path("/nonexistent"))
    assert path.read_bytes() == b"eight"
    assert path.parent.name == COMMIT  # pinned to the commit `main` pointed at
    with pytest.raises(PackageError, match=r"no GGUF named with quant Q2_K.*d.Q4_K_M.gguf"):
        hub.resolve_draft("org/drafts:Q2_K", Path("/nonexistent"))
    with pytest.raises(PackageError, match=r"org/absent is not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        hub.resolve_draft("org/absent:Q8_0", Path("/nonexistent"))


def test_file_draft_resolves_from_the_cache(hf_offline):
    add_files(hf_offline, "org/drafts", COMMIT, {"sub/tiny.gguf": b"tiny"})
    assert hub.resolve_draft(f"hf://org/drafts@{COMMIT}/sub/tiny.gguf", Path(".")).read_bytes() == b"tiny"
    assert hub.resolve_draft("hf://org/drafts/sub/tiny.gguf", Path(".")).read_bytes() == b"tiny"
    with pytest.raises(PackageError, match=r"sub/other.gguf of hf://org/drafts.* is not in the Hugging Face cache"):
        hub.resolve_draft("hf://org/drafts/sub/other.gguf", Path("."))


def test_relative_draft_inside_a_local_package(tmp_path):
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "d.gguf").write_bytes(b"d")
    assert hub.resolve_draft("drafts/d.gguf", tmp_path) == tmp_path / "drafts" / "d.gguf"
    with pytest.raises(PackageError, match="draft model not found"):
        hub.resolve_draft("drafts/missing.gguf", tmp_path)
    with pytest.raises(PackageError, match="escapes"):
        hub.resolve_draft("../d.gguf", tmp_path / "drafts")


def test_relative_draft_of_a_hub_package_comes_from_the_same_commit(hf_offline, tiny_package):
    cache_package(hf_offline, "org/tiny", tiny_package)
    add_files(hf_offline, "org/tiny", COMMIT, {"drafts/d.gguf": b"draft"}, branch=None)
    pkg = hub.open_package(parse_hub_ref("hf://org/tiny"))
    # The package dir is the snapshot: a draft path resolves inside it, with the same pinned commit.
    assert hub.resolve_draft("drafts/d.gguf", pkg.root).read_bytes() == b"draft"
    assert hub.pinned_ref_of(pkg.root) == HubRef("org/tiny", COMMIT)
    assert hub.package_ref(pkg.root) == f"hf://org/tiny@{COMMIT}"
    assert hub.package_ref(tiny_package) == str(tiny_package)
