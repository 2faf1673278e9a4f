"""Benchmark suite: `python -m bench` (`make bench`) runs every bench/*_bench.py module and
writes one report. The module interface is documented in docs/loadgen.md."""
