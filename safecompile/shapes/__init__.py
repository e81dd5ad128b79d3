"""Shape buckets: planning, padding and cutting back, and the table of verified buckets.

Builds on :mod:`safecompile.base` and :mod:`safecompile.observe` only.
"""
