"""Transports: one module each, behind the `Transport` Protocol of `base.py`."""
