"""Judging a compiled call: comparing outputs, state snapshots, the speed verdict, timings.

Pure parts, with no knowledge of the guard; builds on :mod:`safecompile.base` only.
"""
