"""CPU sets: `mesh stage --cpus` and `mesh serve --stage-cpus` pin each process, with every
thread it runs, to its own cores, as if each stage were a machine of its own."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest
from mesh_server import mesh_serve
from models import write_tiny_llama

from bench.harness.local_server import stage_pids
from config.settings import UsageError
from mesh.cli import serve
from mesh.cli.main import build_parser
from packages.writer import write_package
from stage.cpus import CpuSetError, available_cpus, format_cpus, parse_cpus, pin

CPUS = sorted(available_cpus())


def test_cpu_lists_parse_numbers_and_ranges_and_refuse_the_rest():
    first = CPUS[0]
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(format_cpus(set(CPUS))) == set(CPUS)
    if len(CPUS) > 1:
        assert parse_cpus(f"{CPUS[0]}-{CPUS[1]}") >= {CPUS[0], CPUS[1]}
    for bad in ("", "a", "1-", "-1", "3-1", "0,,1", str(max(CPUS) + 1000)):
        with pytest.raises(CpuSetError):
            parse_cpus(bad)


def test_pin_covers_threads_that_run_now_and_those_started_later():
    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    running = threading.Event()
    release = threading.Event()

    def worker() -> None:
        running.set()
        release.wait(5)
        seen.append(os.sched_getaffinity(0))

    old = threading.Thread(target=worker)
    old.start()
    running.wait(5)
    try:
        pin(frozenset({CPUS[0]}))
        release.set()
        old.join()
        later: list[set[int]] = []
        new = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        new.start()
        new.join()
        assert seen == [{CPUS[0]}]
        assert later == [{CPUS[0]}]
    finally:
        pin(frozenset(before))


def _serve_args(*argv: str):
    return build_parser("serve").parse_args(["serve", *argv])


def test_serve_wants_one_cpu_list_per_local_stage_and_then_takes_no_cpu_lock(tmp_path: Path):
    with pytest.raises(UsageError, match="one CPU list per local stage"):
        serve._check(_serve_args("--local-stages", "3", "--stage-cpus", "0", "0"))
    with pytest.raises(CpuSetError):
        serve._check(_serve_args("--local-stages", "1", "--stage-cpus", "99999"))
    pinned = _serve_args("--local-stages", "2", "--stage-cpus", str(CPUS[0]), str(CPUS[-1]))
    serve._check(pinned)
    assert serve._cpu_lock(pinned, tmp_path) is None
    assert serve._threads(pinned) == 0  # each process: one engine thread per CPU of its set
    assert serve._threads(_serve_args("--stage-cpus", "0", "--threads", "3")) == 3
    shared = _serve_args("--local-stages", "2", "--threads", str(os.cpu_count()))
    assert serve._cpu_lock(shared, tmp_path) == tmp_path / "cpu.lock"


@pytest.mark.mesh
@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_serve_pins_itself_and_each_local_stage_to_its_own_cpus(tmp_path: Path):
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", byte_vocab=True)
    package = tmp_path / "pkg"
    write_package(gguf, package, model_id="tiny", progress=lambda _: None)
    first, second = CPUS[0], CPUS[1]
    with mesh_serve(tmp_path, "--model", str(package), "--no-draft", "--local-stages", "2",
                    "--stage-cpus", str(first), str(second)) as (_, proc):
        (stage,) = stage_pids(proc.pid)
        for pid, cpus in ((proc.pid, [first]), (stage, [second])):
            process = psutil.Process(pid)
            assert process.cpu_affinity() == cpus
            assert all(psutil.Process(t.id).cpu_affinity() == cpus for t in process.threads())
        assert "--cpu-lock" not in psutil.Process(stage).cmdline()
