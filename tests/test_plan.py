"""`mesh plan` on header-only GGUFs of four frontier models' published shapes: the header
reader takes a file that ends where its header does, the parameter counts come out as the
models' cards say, the cut and the fit are the planner's and the fit check's, and an hf://
file is read by range, its header only."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gguf_headers import SHAPES, gpt_oss_120b

from mesh.cli.main import main
from mesh.cli.plan import format_plan, memory_size
from mesh.routing.header_plan import PlanAsk, plan_model
from mesh.routing.planner import plan_ranges
from packages.architectures import split_refusal
from packages.gguf_infos import read_header
from packages.parameters import EXPERT_TENSORS

GiB = 1 << 30
# (total, active) parameters in billions as the model cards give them; active here counts the
# embeddings and head too (2 x 0.95B on GLM-5), so it runs up to 2B over a card that leaves them out
CARDS = {"qwen3.5-397b-a17b": (397, 17), "deepseek-v3.2": (671, 37), "glm-5": (744, 40),
         "gpt-oss-120b": (117, 5.1)}


@pytest.fixture(scope="module")
def headers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("headers")
    return {name: write(folder / f"{name}.gguf") for name, write in SHAPES.items()}


def test_the_reader_takes_a_file_that_ends_with_its_header(headers: dict[str, Path]) -> None:
    info = read_header(headers["deepseek-v3.2"])
    assert info.header_bytes == headers["deepseek-v3.2"].stat().st_size  # no byte of tensor data
    shapes = {t.name: t.shape for t in info.tensors}
    assert shapes["blk.3.ffn_up_exps.weight"] == (7168, 2048, 256)
    assert shapes["blk.0.attn_kv_a_mqa.weight"] == (7168, 576)
    assert info.value("deepseek32.expert_used_count") == 8


@pytest.mark.parametrize("name", sorted(CARDS))
def test_parameters_are_the_cards(headers: dict[str, Path], name: str) -> None:
    plan = plan_model(read_header(headers[name]), PlanAsk((1024 * GiB,)))
    total, active = CARDS[name]
    assert plan.parameters / 1e9 == pytest.approx(total, rel=0.02)
    assert active <= plan.active / 1e9 <= active + 2.0
    assert plan.experts_used < plan.experts_total
    assert plan.fits
    assert [s.short for s in plan.stages] == [0]


@pytest.mark.parametrize("name", sorted(CARDS))
def test_a_model_that_cannot_split_is_planned_on_one_node_and_says_why(headers: dict[str, Path], name: str) -> None:
    info = read_header(headers[name])
    plan = plan_model(info, PlanAsk((256 * GiB, 1024 * GiB)))
    if plan.splits:
        assert len(plan.stages) == 2
        return
    reason = split_refusal(info.architecture)
    assert [(s.machine, s.start, s.end) for s in plan.stages] == [(1, 0, plan.layers)]  # the larger machine
    assert f"splits:     no — {reason or 'no cut'}" in format_plan(name, plan)


def test_the_cut_is_the_planners_and_every_stage_is_sized(headers: dict[str, Path]) -> None:
    info = read_header(headers["gpt-oss-120b"])
    plan = plan_model(info, PlanAsk((96 * GiB, 64 * GiB), lanes=2, ctx=4096))
    layers = [(s.start, s.end) for s in plan.stages]
    assert [a for a, _ in layers] == [0, layers[0][1]]
    assert layers[-1][1] == 36
    assert layers[0][1] % 2 == 0  # a stage starts with a sliding-window layer (gpt-oss)
    weights = [t.n_bytes for t in info.tensors if t.name.startswith("blk.")]
    embd_and_head = sum(t.n_bytes for t in info.tensors if not t.name.startswith("blk."))
    assert sum(s.weights for s in plan.stages) == sum(weights) + embd_and_head
    # K and V of 8 heads of 64, f16, every layer, 4096 positions
    assert [s.kv_per_lane for s in plan.stages] == [(b - a) * 4096 * 2 * 1024 for a, b in layers]
    assert [s.total for s in plan.stages] == [s.weights + 2 * s.kv_per_lane + (32 << 20) for s in plan.stages]
    assert plan.fits


def test_the_cut_is_plan_ranges_on_active_parameters(headers: dict[str, Path]) -> None:
    info = read_header(headers["gpt-oss-120b"])
    plan = plan_model(info, PlanAsk((200 * GiB, 100 * GiB)))
    per_layer = [sum(t.n_elements * (4 / 128 if t.name.split(".")[2] in EXPERT_TENSORS else 1) for t in info.tensors
                     if t.name.startswith(f"blk.{i}.")) for i in range(36)]
    head = next(t.n_elements for t in info.tensors if t.name == "output.weight")
    ranges = plan_ranges(36, range(2, 36, 2), [200.0, 100.0], per_layer, head)
    assert [(s.start, s.end) for s in plan.stages] == [(r.start, r.end) for r in ranges]


def test_a_machine_short_of_memory_is_named_with_the_shortfall(headers: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(headers["gpt-oss-120b"]), "--machine", "32G", "--machine", "16G"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "fits:       no — machine 0 (32.0 GiB) is " in out
    assert "lower --lanes or --ctx-size, or add a stage" in out  # the fit check's own words, as serve says them


def test_json_for_scripts(headers: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(headers["glm-5"]), "--machine", "512G", "--ctx-size", "8192", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (plan["fits"], plan["architecture"], plan["layers"], plan["dropped_layers"], plan["ctx"]) == \
        (True, "glm-dsa", 78, 1, 8192)
    # MLA keeps the 512-wide latent and 64 RoPE dims, no V; the indexer its 128-wide keys: f16
    assert plan["stages"][0]["kv_per_lane"] == 78 * 8192 * 2 * (576 + 128)


def test_memory_sizes_binary_and_decimal() -> None:
    assert memory_size("512G") == memory_size("512GiB") == 512 << 30
    assert memory_size("64GB") == 64 * 10**9
    assert memory_size("1.5T") == 3 << 39
    assert memory_size("1000") == 1000
    for bad in ("lots", "12X", "0G", "-4G"):
        with pytest.raises(Exception, match=r"size|positive"):
            memory_size(bad)


@pytest.fixture
def hub_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bytes], list[int]]]:
    """A local stand-in for the Hub's `resolve` endpoint that honours Range; returns how to
    serve a file and the bytes it sent."""
    sent: list[int] = []
    served: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name for it
            if "/resolve/" not in self.path:  # huggingface_hub's own asks (its agent registry)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = served[self.path.rsplit("/", 1)[-1]]
            first, last = self.headers["Range"].removeprefix("bytes=").split("-")
            part = body[int(first):int(last) + 1]
            self.send_response(206)
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            self.wfile.write(part)
            sent.append(len(part))

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"  # as HF_ENDPOINT sets both at import
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", endpoint)
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)

    def serve(data: bytes) -> list[int]:
        served["model.gguf"] = data
        return sent

    yield serve
    server.shutdown()


def test_an_hf_file_is_read_by_range_header_only(hub_server: Callable[[bytes], list[int]], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    header = gpt_oss_120b(tmp_path / "h.gguf").read_bytes()
    sent = hub_server(header + bytes(24 << 20))  # weights past the header, never asked for
    rc = main(["plan", "--model", "hf://org/model@main/model.gguf", "--machine", "128G"])
    assert rc == 0, capsys.readouterr().err
    assert "gpt-oss, 36 layers" in capsys.readouterr().out
    assert sum(sent) < 8 << 20  # the first range alone
