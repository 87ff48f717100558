"""Benchmark harness: datasets, load generator, serving metrics, reports and the classic experiments.

Layout:
    datasets.py     offline prompt sets (random / prefix / sharegpt / jsonl) with exact token lengths
    metrics.py      pure metric math on per-request timelines (TTFT, TPOT, ITL, E2E, goodput, percentiles)
    loadgen.py      one asyncio process: arrival processes, OpenAI streaming client, per-chunk timestamps
    report.py       console table, JSON (args + summary + records), optional matplotlib plots
    offline.py      `lmserve bench offline`: in-process lmserve engine or HF transformers
    harness.py      what the experiments and the benchmark scripts stand on: a server subprocess (start, wait for
                    /health, stop), the experiments' sizes and results, Harness (servers, prompts, load runs)
    experiments.py  `lmserve bench experiments`: the six classic serving experiments, Markdown report
"""
