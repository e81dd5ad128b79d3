"""What every layer shares: the records handed out, the policies, errors, the kill switch.

Imports nothing else of safecompile.
"""
