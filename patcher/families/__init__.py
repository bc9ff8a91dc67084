"""Loader families: one module per family (`UNIT = Family(...)`, see base.py), found by registry.py."""
