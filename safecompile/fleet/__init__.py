"""Many processes as one: ranks that agree, and the fleet-wide kill switch."""
