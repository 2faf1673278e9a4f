"""Wire contracts shared by the control plane, the agents and the engine.

No Django and no PyTorch import, so that `agent/` and a control plane without the engine
can use them: the Redis stream names and entry schemas, who may touch which Redis keys,
the exact bytes a release signature covers, the tokenizer both sides count with, and how
every process sets up its traces and passes their context on (`tracing.py`).
"""
