"""Stand-alone tools still used by open work.

Run as ``python -m benchmarks.scripts.<name>``. Measurements users rerun are
suites (``benchmarks/suites``); the scripts retired on 2026-12-02 are listed
in ``benchmarks/results/README.md``.
"""
