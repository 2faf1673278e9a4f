"""The worker agent: runs one engine per accelerator, steered through Redis."""
