"""A user module that fails on import (the contract must report it, not crash)."""

raise RuntimeError("boom at import")
