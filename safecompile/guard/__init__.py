"""The guard: the decorator, the controller, the call paths, graphs, checks and trips."""
