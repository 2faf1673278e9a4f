"""Telemetry: the Redis streams agents and gateways write, and everything ingest makes of them.

The ingest process (`manage.py ingest`) runs a StreamIngestor over the streams; each
stream has a handler here that parses its entries (contracts/) and writes what they
mean: agents' state and rollups, command outcomes, request samples, prompt records and
usage; energy is attributed to tenants from the rollups.
"""
