"""`mesh bench --scenarios peers` without a server: llama.cpp's command lines, the split check,
the skip message, and the rows and tables made from samples."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from bench.harness import llama_cpp
from bench.harness.client import StreamTiming, cuts_of
from bench.harness.harness import Asked
from bench.harness.llama_cpp import (
    Binaries,
    LlamaCppError,
    RpcSplit,
    ServerSpec,
    rpc_server_cmd,
    server_cmd,
    split_evidence,
)
from bench.harness.machines import Machines
from bench.run import _llama_cpp_bins, add_parser, fill_defaults
from bench.scenarios import peers
from bench.scenarios.peers import (
    LLAMA_ONE,
    LLAMA_UNITS,
    MESH3_DEFAULT,
    MESH3_PLAIN,
    MESH_DEFAULT,
    MESH_ONE,
    MESH_PLAIN,
    RATIOS,
    RPC,
    RPC3,
    RPC3_SPEC,
    RPC_SPEC,
    Record,
    controller_choice,
    cuts_note,
    goal,
    rows_of,
    rpc_layers,
    sharing_note,
    skipped_message,
    tables,
    units_of,
)
from mesh.api.responses import ControllerUsage, SpeculativeUsage
from mesh.reports.health import Health, StageHealth

BINS = Binaries(Path("/opt/llama"))


def _flag(cmd: list[str], flag: str) -> str:
    """A flag's value on the binary's own command line (after `taskset -c CPUS`)."""
    own = cmd[3:]
    return own[own.index(flag) + 1]


# -- llama.cpp command lines ----------------------------------------------------------------------

def test_one_node_llama_server_is_pinned_with_one_thread_per_cpu_and_has_no_rpc_nor_draft():
    cmd = server_cmd(BINS, ServerSpec(Path("t.gguf"), "0", 1024), port=8080)
    assert cmd[:3] == ["taskset", "-c", "0"]
    assert cmd[3] == "/opt/llama/llama-server"
    assert (_flag(cmd, "-t"), _flag(cmd, "-tb"), _flag(cmd, "-m"), _flag(cmd, "-c")) == ("1", "1", "t.gguf", "1024")
    assert _flag(cmd, "--port") == "8080"
    assert _flag(cmd, "-ngl") == "0"
    assert not {"--rpc", "-md", "--spec-type"} & set(cmd)


@pytest.mark.parametrize(("setting", "repacks"), [("on", True), ("off", False)])
def test_llama_server_repacks_weights_only_where_meshpipes_engines_do(monkeypatch, setting, repacks):
    # on an AMX CPU meshpipe loads without extra buffer types, and llama-server's default
    # repack (AMX) segfaults there: both must run the same kernels
    monkeypatch.setenv("MESHPIPE_EXTRA_BUFTS", setting)
    cmd = server_cmd(BINS, ServerSpec(Path("t.gguf"), "0", 1024), port=8080)
    assert ("--no-repack" not in cmd) is repacks


ONE = RpcSplit(("127.0.0.1:5000",), (19,), 30)
TWO = RpcSplit(("127.0.0.1:5000", "127.0.0.1:5001"), (11, 21), 30)


def test_the_rpc_split_puts_the_last_layers_on_the_proxied_rpc_device():
    cmd = server_cmd(BINS, ServerSpec(Path("t.gguf"), "0-1", 1024, ONE), 1)
    # llama.cpp offloads the head first: -ngl 12 of 30 layers is layers 19..29 and the head
    assert (_flag(cmd, "--rpc"), _flag(cmd, "-ngl")) == ("127.0.0.1:5000", "12")
    assert _flag(cmd, "-t") == "2"  # two CPUs in the set
    assert not {"-md", "--tensor-split"} & set(cmd)


def test_two_rpc_devices_divide_the_offloaded_layers_at_meshpipes_second_cut():
    cmd = server_cmd(BINS, ServerSpec(Path("t.gguf"), "0", 1024, TWO), 1)
    # 20 offloaded: layers 11..20 on the first device; 21..29 and the head, 10 shares, on the second
    assert (_flag(cmd, "--rpc"), _flag(cmd, "-ngl")) == ("127.0.0.1:5000,127.0.0.1:5001", "20")
    assert _flag(cmd, "--tensor-split") == "10,10"
    assert TWO.layers == (10, 9)


def test_an_rpc_split_needs_a_link_per_cut_and_ascending_cuts_inside_the_model():
    for links, cuts in ((("a",), (11, 21)), (("a", "b"), (21, 11)), (("a",), (30,)), (("a",), (0,))):
        with pytest.raises(ValueError, match="one link per cut"):
            RpcSplit(links, cuts, 30)


def test_llama_servers_speculation_is_switched_on_with_the_draft_on_the_first_machine():
    spec = ServerSpec(Path("t.gguf"), "0", 1024, ONE, draft=Path("d.gguf"))
    cmd = server_cmd(BINS, spec, 1)
    # without --spec-type llama-server loads the draft and never uses it
    assert (_flag(cmd, "-md"), _flag(cmd, "-ngld"), _flag(cmd, "--spec-type")) == ("d.gguf", "0", "draft-simple")
    assert _flag(cmd, "-td") == "1"


def test_the_rpc_server_is_pinned_to_the_second_machine():
    cmd = rpc_server_cmd(BINS, "1", 5000)
    assert cmd[:4] == ["taskset", "-c", "1", "/opt/llama/ggml-rpc-server"]
    assert (_flag(cmd, "-p"), _flag(cmd, "-t"), _flag(cmd, "-H")) == ("5000", "1", "127.0.0.1")


def _health(*ranges: tuple[int | None, int | None]) -> Health:
    stages = tuple(StageHealth(stage=k, endpoint=f"s{k}", start=a, end=b, state="READY", rss_bytes=None,
                               mem_available_bytes=None, status_at=0.0) for k, (a, b) in enumerate(ranges))
    return Health(ok=True, model="m", route="r", stages=stages[::-1], error=None, speculative="off")


def test_every_cut_of_meshpipes_split_is_read_from_health_in_stage_order():
    assert cuts_of(_health((0, 17), (17, 30))) == (17,)
    assert cuts_of(_health((0, 11), (11, 21), (21, 30))) == (11, 21)
    with pytest.raises(RuntimeError, match="no layer range"):
        cuts_of(_health((0, 11), (None, None)))


SPLIT_LOG = """load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
load_tensors: offloading output layer to GPU
load_tensors: offloading 11 repeating layers to GPU
load_tensors: offloaded 12/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    60.32 MiB
load_tensors: RPC0[127.0.0.1:5000] model buffer size =    24.10 MiB
llama_kv_cache:        CPU KV buffer size =     7.12 MiB
llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     4.12 MiB
"""
# the same server with a draft: the draft's model and KV, all on the CPU, come after
DRAFT_LOG = """load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
load_tensors: offloaded 0/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    85.77 MiB
llama_kv_cache:        CPU KV buffer size =    22.50 MiB
"""
# split-3 as llama-server logged it (SmolLM2, 512 tokens: 0.375 MiB of KV per layer); both
# RPC devices' buffers are named RPC0, after the device's index on its own server
SPLIT3_LOG = """load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
load_tensors: offloaded 20/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
load_tensors: RPC0[127.0.0.1:5000] model buffer size =    21.14 MiB
load_tensors: RPC0[127.0.0.1:5001] model buffer size =    47.72 MiB
llama_kv_cache:        CPU KV buffer size =     4.12 MiB
llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     3.75 MiB
llama_kv_cache: RPC0[127.0.0.1:5001] KV buffer size =     3.38 MiB
"""


def test_the_split_is_confirmed_from_the_log():
    said = "offloaded 12/31 layers; 127.0.0.1:5000: 24.10 MiB of weights, KV for 11 layers"
    assert split_evidence(SPLIT_LOG, ONE) == said
    assert split_evidence(SPLIT_LOG + DRAFT_LOG, ONE) == said  # the draft's CPU buffers do not count


def test_split_3_is_confirmed_device_by_device():
    assert split_evidence(SPLIT3_LOG, TWO) == (
        "offloaded 20/31 layers; 127.0.0.1:5000: 21.14 MiB of weights, KV for 10 layers; "
        "127.0.0.1:5001: 47.72 MiB of weights, KV for 9 layers")


def test_a_log_with_another_layer_count_or_none_on_the_rpc_device_fails():
    with pytest.raises(LlamaCppError, match="12/31"):
        split_evidence(SPLIT_LOG, RpcSplit(ONE.links, (20,), 30))
    with pytest.raises(LlamaCppError, match="no 'offloaded"):
        split_evidence("load_tensors: CPU_Mapped model buffer size = 60 MiB", ONE)
    with pytest.raises(LlamaCppError, match=r"no model weights on the RPC device at 127\.0\.0\.1:5000"):
        split_evidence(SPLIT_LOG.replace("24.10", "0.00"), ONE)
    with pytest.raises(LlamaCppError, match="no KV buffer sizes"):
        split_evidence(SPLIT_LOG.split("llama_kv_cache")[0], ONE)


def test_a_split_3_with_the_layers_divided_elsewhere_or_a_device_without_weights_fails():
    # the same offload divided 11/8 (a --tensor-split that did not take): the KV says so
    moved = SPLIT3_LOG.replace("3.75 MiB", "4.12 MiB").replace("3.38 MiB", "3.00 MiB")
    with pytest.raises(LlamaCppError, match=r"hold \(11, 8\) layers' KV, not \(10, 9\)"):
        split_evidence(moved, TWO)
    with pytest.raises(LlamaCppError, match=r"no model weights on the RPC device at 127\.0\.0\.1:5001"):
        split_evidence(SPLIT3_LOG.replace("47.72", "0.00"), TWO)


def test_a_sliding_window_cache_beside_the_full_one_leaves_the_weights_to_confirm_the_split():
    iswa = SPLIT_LOG + "llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     1.00 MiB\n"
    assert split_evidence(iswa, ONE) == "offloaded 12/31 layers; 127.0.0.1:5000: 24.10 MiB of weights"


def test_a_tiny_models_fraction_of_a_mib_on_the_rpc_device_counts():
    assert split_evidence(SPLIT_LOG.replace("24.10", "0.05"), ONE).startswith("offloaded 12/31 layers")


def test_a_device_with_one_layer_says_so_in_the_singular():
    # layers 19-28 on the first device, 29 and the head on the second
    one = SPLIT3_LOG.replace("20/31", "12/31").replace("4.12 MiB", "7.12 MiB").replace("3.38 MiB", "0.38 MiB")
    assert split_evidence(one, RpcSplit(TWO.links, (19, 29), 30)).endswith("KV for 1 layer")


# -- what is skipped ------------------------------------------------------------------------------

def test_without_the_binaries_the_message_names_the_skipped_rows_and_how_to_build_them():
    message = skipped_message(None, (1, 2, 3))
    assert all(unit in message for unit in LLAMA_UNITS)
    assert "--llama-cpp-bin" in message
    assert "deploy/build-llama-cpp.sh" in message


def test_a_directory_missing_a_binary_is_named_with_the_binary(tmp_path):
    (tmp_path / llama_cpp.SERVER).write_text("")
    assert skipped_message(Binaries(tmp_path)).endswith(
        f"{tmp_path} lacks ggml-rpc-server (build them with deploy/build-llama-cpp.sh, docs/bench.md)")
    (tmp_path / llama_cpp.RPC_SERVER).write_text("")
    assert skipped_message(Binaries(tmp_path)) == ""


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_peers_alone_takes_its_short_defaults_and_always_emulates_machines(tmp_path):
    args = _args("--scenarios", "peers")
    fill_defaults(args, {"peers"})
    assert (args.tokens, args.prompts, args.stages) == (64, 3, "1,2")
    assert _llama_cpp_bins(args, {"peers"}) is None
    assert args.machines


def test_a_llama_cpp_bin_that_lacks_a_binary_fails_before_anything_loads(tmp_path):
    args = _args("--scenarios", "peers", "--llama-cpp-bin", str(tmp_path))
    with pytest.raises(SystemExit, match="lacks llama-server, ggml-rpc-server"):
        _llama_cpp_bins(args, {"peers"})


# -- rows and tables ------------------------------------------------------------------------------

def _record(costly: bool = False, llama: bool = True) -> Record:
    record = Record("same-cost pair: Q4_1 target, Q4_0 draft", costly)
    tps = {LLAMA_ONE: [70.0, 80.0, 75.0], RPC: [17.0, 18.0], RPC_SPEC: [20.0], MESH_ONE: [72.0],
           MESH_PLAIN: [18.0], MESH_DEFAULT: [36.0]}
    record.tps = {(20.0, unit): samples for unit, samples in tps.items() if llama or unit not in LLAMA_UNITS}
    return record


def test_each_server_gets_its_median_and_each_ratio_its_goal():
    rows = {r.metric: r for r in rows_of(_record(), [20.0])}
    assert rows[f"{LLAMA_ONE} decode tok/s"].value == 75.0
    assert rows[f"{RPC} decode tok/s"].samples == [17.0, 18.0]
    default_vs_plain = rows[RATIOS[3][0]]
    assert default_vs_plain.ratio == 2.0
    assert default_vs_plain.goal == ">= 1.8"
    assert rows[RATIOS[2][0]].ratio == pytest.approx(1.8)
    assert all(r.scenario == "peers same-cost pair: Q4_1 target, Q4_0 draft, 20 ms" for r in rows.values())


def test_the_cost_realistic_pair_is_held_to_its_own_speculation_goal():
    assert goal(RATIOS[3][0], 20, costly=True) == ">= 2.5"
    assert goal(RATIOS[3][0], 20, costly=False) == ">= 1.8"
    assert goal(RATIOS[3][0], 0, costly=False) == ">= 0.98"
    assert goal(RATIOS[0][0], 0, costly=True) == ">= 1.05"


def test_without_llama_cpp_only_meshpipes_ratio_remains_and_the_table_says_skipped():
    record = _record(llama=False)
    rows = rows_of(record, [20.0])
    assert [r.metric for r in rows if r.baseline] == [RATIOS[3][0]]
    table = tables(record, [20.0])
    line = next(line for line in table.splitlines() if line.startswith("| 20 ms") and "36.0" in line)
    assert line.count("skipped") == 3  # llama-server and the two RPC split-2 servers


def test_the_table_has_a_column_per_server_and_per_ratio():
    table = tables(_record(), [20.0]).splitlines()
    assert table[0] == "peers, same-cost pair: Q4_1 target, Q4_0 draft: decode tok/s"
    assert table[2].count("|") == 8  # delay + six servers
    assert "| 20 ms | 75.0 | 17.5 | 20.0 | 72.0 | 18.0 | 36.0 |" in table
    assert "2.00 (goal >= 1.8)" in "\n".join(table)


def _timing(controller: dict[str, ControllerUsage] | None) -> StreamTiming:
    spec = SpeculativeUsage(windows=4, proposed=4, accepted=3, accept_rate=0.75, mean_window=1.0, controller=controller)
    return StreamTiming(0.1, (0.1, 0.2), 2, spec)


def test_the_table_says_what_the_defaults_controller_chose_at_each_delay():
    on = ControllerUsage(window=1, frames_in_flight=3, predicted_tok_s=28.0, plain_tok_s=18.0, why="")
    off = ControllerUsage(window=0, frames_in_flight=1, predicted_tok_s=60.0, plain_tok_s=60.0, why="")
    assert controller_choice(_timing({"draft": on})) == "window 1, 3 frames out"
    assert controller_choice(_timing({"draft": off})) == "off"
    one = ControllerUsage(window=2, frames_in_flight=1, predicted_tok_s=20.0, plain_tok_s=18.0, why="")
    assert controller_choice(_timing({"draft": one})) == "window 2, 1 frame out"
    assert controller_choice(_timing(None)) is None
    record = _record()
    record.choices[(20.0, MESH_DEFAULT)] = Counter({"window 1, 3 frames out": 3, "off": 1})
    assert ("- 20 ms: the defaults' controller ended window 1, 3 frames out in 3, off in 1 of 4 requests"
            in tables(record, [20.0]).splitlines())


def test_the_table_says_where_each_meshpipe_split_cut():
    """The no-draft and the defaults servers re-cut on their own calibrations: a table whose
    ratio compares two cuts says so."""
    record = _record()
    record.notes[2] = [cuts_note(0.0, (17,), (17,)), cuts_note(20.0, (16,), (19,))]
    lines = tables(record, [20.0]).splitlines()
    assert "- 0 ms: meshpipe's split-2 servers both cut at layer 17" in lines
    assert ("- 20 ms: meshpipe's split-2 cut at layer 16 without a draft and at layer 19 with its defaults "
            "(each re-cut on its own calibrations at start)") in lines
    assert cuts_note(5.0, (11, 21), (11, 21)) == "5 ms: meshpipe's split-3 servers both cut at layers 11 and 21"


# -- split-3 --------------------------------------------------------------------------------------

def _record3(stages: tuple[int, ...] = (1, 2, 3)) -> Record:
    record = _record()
    record.stages = stages
    tps = {RPC3: [10.0], RPC3_SPEC: [9.0], MESH3_PLAIN: [14.0], MESH3_DEFAULT: [21.0]}
    record.tps |= {(20.0, unit): samples for unit, samples in tps.items()}
    return record


def test_split_3_is_measured_only_when_stages_asks_for_it():
    assert units_of((1, 2)) == (LLAMA_ONE, RPC, RPC_SPEC, MESH_ONE, MESH_PLAIN, MESH_DEFAULT)
    assert units_of((3,)) == (RPC3, RPC3_SPEC, MESH3_PLAIN, MESH3_DEFAULT)
    assert RPC3 == "llama.cpp RPC split-3"
    assert MESH3_DEFAULT == "meshpipe split-3, defaults (draft)"
    assert RPC3 not in skipped_message(None)
    assert RPC3 in skipped_message(None, (1, 2, 3))


def test_split_3_has_a_table_of_its_own_with_issue_42s_goals():
    record = _record3()
    record.notes[3] = ["split-3: stages 0 and 2 share CPUs 0, ..."]
    both = tables(record, [20.0])
    first, third = both[:both.index("\n\npeers, ")], both[both.index("\n\npeers, ") + 2:]
    assert "split-3" not in first
    lines = third.splitlines()
    assert lines[0] == "peers, same-cost pair: Q4_1 target, Q4_0 draft: split-3 decode tok/s"
    assert lines[2] == f"| one-way delay | {RPC3} | {RPC3_SPEC} | {MESH3_PLAIN} | {MESH3_DEFAULT} |"
    assert "| 20 ms | 10.0 | 9.0 | 14.0 | 21.0 |" in lines
    assert "| 20 ms | 1.40 (goal >= 1.25) | 2.33 (goal >= 2.0) | 1.50 |" in lines
    assert lines[-1] == "- split-3: stages 0 and 2 share CPUs 0, ..."
    rows = {r.metric: r for r in rows_of(record, [20.0])}
    assert rows[RATIOS[4][0]].goal == ">= 1.25"
    assert rows[RATIOS[5][0]].goal == ">= 2.0"
    assert goal(RATIOS[4][0], 5, costly=True) == ""
    assert goal(RATIOS[5][0], 20, costly=True) == ">= 2.0"
    assert goal(RATIOS[6][0], 20, costly=False) == ""
    assert tables(_record3((3,)), [20.0]) == third.replace("\n- split-3: stages 0 and 2 share CPUs 0, ...", "")


def test_the_tables_say_which_stages_share_a_core_in_both_systems_alike():
    two = Machines(("0", "1"))
    assert sharing_note(two, 2) == ""
    assert sharing_note(two, 3) == (
        "split-3: stages 0 and 2 share CPUs 0, in both systems alike (llama.cpp's llama-server and RPC server 2, "
        "meshpipe's stages 0 and 2; one thread each, taking turns on the core)")
    assert sharing_note(Machines(("0", "1", "2")), 3) == ""


def test_the_rpc_note_names_each_devices_layers():
    assert rpc_layers(ONE) == "layers 19-29 and the head on the RPC device"
    assert rpc_layers(TWO) == "layers 11-20 on RPC device 1, 21-29 and the head on RPC device 2"
    # meshpipe's planner may leave its last stage one layer and the head
    assert (rpc_layers(RpcSplit(TWO.links, (11, 29), 30))
            == "layers 11-28 on RPC device 1, 29 and the head on RPC device 2")


def test_peers_takes_stages_1_2_and_3_only(monkeypatch):
    monkeypatch.setattr(peers, "package_draft", lambda setup: Path("d.gguf"))
    asked = Asked(None, argparse.Namespace(stages="2,4"), [0.0], ["p"])  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="1 node, split-2 and split-3"):
        peers.run(asked)
