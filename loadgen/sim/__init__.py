"""Discrete-event simulator: the worker's real scheduler, policies and KV manager, with the
model's forward pass replaced by a step-time (cost) model. See docs/simulator.md."""
