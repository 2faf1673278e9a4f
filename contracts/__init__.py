"""Wire contracts shared by the control plane, the agents and the engine.

Pure Python with no Django import, so that `agent/` can use them: the Redis
stream names and entry schemas, and the exact bytes a release signature covers.
"""
