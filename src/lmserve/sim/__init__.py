"""`lmserve simulate`: the engine's own scheduler on a model of how long a step takes.

The scheduler (core/scheduler.py), the KV cache manager and its prefix cache import no torch, so the very code
that decides each step of the real engine runs here against a step-time model instead of the model runner:

    step_model.py   StepFeatures (core.outputs.step_features of a step); LinearStepModel (fitted from
                    profiled steps) and RooflineStepModel (an analytic estimate from a hardware description); the JSON
                    file both are saved as (machine, model, dtype, KV dtype, quantization, API overheads)
    workload.py     the requests: the bench harness's datasets (token ids from the model's tokenizer), its
                    arrival process (Poisson / gamma), or a recorded `lmserve bench serve` JSON
    simulator.py    event-driven replicas (no sleeping, no threads): Scheduler.schedule → step time →
                    update_from_output, DP routing with the server's rule (engine/router.py), the client's
                    concurrency cap; RequestRecords that bench/metrics.summarize turns into bench serve's report
    calibrate.py    time real LLMEngine steps over a grid, fit, measure the server's overheads, save
    plan.py         search a configuration space for the cheapest one meeting goodput SLOs
"""
