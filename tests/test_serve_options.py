"""`mesh serve --help` lists what an operator sets; the benchmark-only flags that `mesh bench`
passes are left out of it and still parse."""

from __future__ import annotations

import pytest

from mesh.cli.bench_args import BENCH_ONLY_FLAGS
from mesh.cli.main import build_parser


def test_serve_help_leaves_out_the_benchmark_only_flags(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--help"])
    listing = capsys.readouterr().out
    assert "--lanes" in listing  # the listing is the real one
    assert "--cpu-lock" in listing
    for flag in BENCH_ONLY_FLAGS:
        assert flag not in listing


def test_the_benchmark_only_flags_still_parse():
    args = build_parser("serve").parse_args(
        ["serve", "--wire-delay-ms", "20", "--wire-jitter-ms", "2.5", "--relay-replies",
         "--local-stages", "2", "--stage-cpus", "0", "1"])
    assert (args.wire_delay_ms, args.wire_jitter_ms, args.relay_replies) == (20.0, 2.5, True)
    assert args.stage_cpus == ["0", "1"]
    plain = build_parser("serve").parse_args(["serve"])
    assert (plain.wire_delay_ms, plain.wire_jitter_ms, plain.relay_replies, plain.stage_cpus) == (0.0, 0.0, False, None)
