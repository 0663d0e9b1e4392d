"""Stand-alone measurements: ``python -m benchmarks.scripts.<name>``."""
