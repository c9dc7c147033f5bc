"""Test-only stand-in: see _custom_ops.py."""
