"""What outlives a process: the local cache directory, the Redis tier, warm restarts."""
