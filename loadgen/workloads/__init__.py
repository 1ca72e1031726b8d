"""Workloads: length distributions, request specs, arrival-driven and closed-loop sources."""
