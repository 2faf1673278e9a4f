"""Wire contracts shared by the control plane, the agents and the engine.

No Django and no PyTorch import, so that `agent/` and a control plane without the engine
can use them: the Redis stream names and entry schemas, who may touch which Redis keys,
the exact bytes a release signature covers, and the tokenizer both sides count with.
"""
