"""Load generator for OpenAI-compatible endpoints: workload replay, SLO goodput, energy per token.

`python -m loadgen --help` for the command line; `docs/loadgen.md` for the workloads, the
measurements and the files it writes. The Python entry point is `loadgen.runner.run_load`.
"""
