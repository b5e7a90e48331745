"""The benchmark: `mesh bench` and the standalone measurements, driving the mesh from outside.

`run.py` is `mesh bench` (its parser, and the one list of scenarios, in the order a run measures
them); `scenarios/` holds one module per scenario, named as `--scenarios` names it; `harness/`
holds what they share (the setup, rows, the llama.cpp baseline, `mesh serve` children, the
streaming client, llama.cpp's servers, the delay proxy). `row_cost.py` and `ui_streams.py` run
on their own (`python -m bench.row_cost`, `python -m bench.ui_streams`).

The bench may import anything of mesh/, stage/, packages/, config/, common/ and proto/; none of
them imports bench/, except `mesh bench`'s lazy dispatch in mesh/cli/main.py (by module name).
"""
