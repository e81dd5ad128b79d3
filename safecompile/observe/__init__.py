"""Seeing what happened: logs, OpenTelemetry, source lines, plain-word errors, progress.

Builds on :mod:`safecompile.base` only.
"""
