"""`lmserve simulate`: the engine's own scheduler on a model of how long a step takes.

The torch-free scheduler and KV cache manager run against a step-time model instead of the model runner:
step_model (StepProfile: fitted or roofline), workload (requests and arrivals), simulator (event-driven replicas),
calibrate (time real steps and fit), plan (search configurations for goodput SLOs). See docs/simulator.md.
"""
