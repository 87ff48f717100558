"""Benchmark harness (`lmserve bench`): datasets, load generator, serving metrics, reports and the classic experiments.

datasets (offline prompt sets with exact token lengths), metrics (pure metric math), loadgen (asyncio OpenAI / gRPC
client), report (table, JSON, plots), offline (in-process engine or HF), harness (server subprocess, Harness),
experiments (the classic serving experiments). See docs/benchmarking.md.
"""
