"""The people-facing dashboard: server-rendered pages over the domain selectors and services."""
