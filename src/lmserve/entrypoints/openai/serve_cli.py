"""`lmserve serve [MODEL | --model DIR_OR_HUB_ID] [--host] [--port] ...`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys

from lmserve.config.args import add_engine_args, engine_kwargs, model_path
from lmserve.memory.ledger import format_bytes

# lmserve.engine.core_client.CPU_POLICIES (kept import-free)
CPU_POLICY_NAMES = ("adaptive", "bounded", "passive", "spin")

logger = logging.getLogger("lmserve.serve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model (as `vllm serve`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the gRPC API (lmserve.v1.Generation, health, reflection) on this port, same host and "
        "engine (needs the grpc extra: pip install 'lmserve[grpc]')",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("LMSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $LMSERVE_API_KEY; unset = open)",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="sequences that cannot start because the engine is full (max_num_seqs or KV blocks) beyond "
        "which requests get 429 with Retry-After (default: unbounded)",
    )
    p.add_argument(
        "--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 4 MiB)"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads PER engine core (default: $OMP_NUM_THREADS or the usable cores, divided by "
        "--data-parallel-size, at least 1)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine-core processes, each with its own KV pool and threads (pinned to its own CPUs when > 1); "
        "requests are routed by load with prefix affinity (default 1)",
    )
    p.add_argument(
        "--disaggregation",
        default=None,
        metavar="NPmD",
        help="prefill/decode disaggregation in this server: N prefill and m decode engine cores (1P1D, 2P1D, ...), "
        "each on its own CPUs; a request is prefilled on one, its KV pulled by the other, which decodes",
    )
    p.add_argument(
        "--kv-lease-s",
        type=float,
        default=None,
        help="--disaggregation: a prefill core frees KV a decode core has not pulled after this long (default 30)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=["fail", "recompute"],
        default="fail",
        help="--disaggregation: a KV transfer that fails or times out ends the request with an error (fail, 503) or "
        "the decode core prefills it itself (recompute, counted in lmserve:kv_transfer_recomputes_total)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default="mp",
        help="how engine cores run: local processes (mp, default) or Ray actors (ray: a local Ray, or the "
        "cluster at $RAY_ADDRESS; needs pip install 'lmserve[ray]')",
    )
    p.add_argument(
        "--cpu-wait-policy",
        choices=sorted(CPU_POLICY_NAMES),
        default="adaptive",
        help="how the engine's OpenMP workers wait between operations: adaptive (default: bounded, and one "
        "thread while other processes use the engine's CPUs), bounded (spin briefly, then sleep), spin "
        "(libgomp's long spins), passive (sleep at once); docs/performance.md has the measurements",
    )
    p.add_argument(
        "--in-process-engine",
        action="store_true",
        help="run the engine on a thread of the API process (no engine-core process; for comparisons)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under NAME, the request's `model` field (needs --enable-lora)",
    )
    p.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="split the model's reasoning into message.reasoning_content: qwen3, deepseek_r1, gpt_oss, granite; "
        "auto (default: chosen from the chat template's markers) or none",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice auto is served whenever the chat template renders tools",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="the model's tool-call format for tool_choice auto: hermes, qwen3_coder, llama3_json, mistral, "
        "pythonic, openai; auto (default: chosen from the chat template, else hermes)",
    )
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template replacing the model's")
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='kwargs every chat request passes to the template, e.g. \'{"enable_thinking": false}\' (a request\'s '
        "chat_template_kwargs override them)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="the Responses API keeps at most this many stored responses (store: true; previous_response_id, GET "
        "/v1/responses/ID) in memory, the oldest dropped first; 0 stores none (default 1000)",
    )
    p.add_argument(
        "--responses-store-ttl-s",
        type=float,
        default=3600.0,
        help="stored responses are dropped this many seconds after they were stored (default 3600)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", dest="access_log", action="store_false", help="do not log each request")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from lmserve.config.engine import EngineArgs
    from lmserve.engine.async_engine import AsyncEngine
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.entrypoints.openai.response_store import ResponseStore
    from lmserve.entrypoints.openai.server import DEFAULT_MAX_REQUEST_BODY_BYTES, build_app

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        print("lmserve serve: error: --max-queued-requests must be >= 0", file=sys.stderr)
        return 2
    if args.num_threads is not None and args.num_threads < 1:
        print("lmserve serve: error: --num-threads must be >= 1", file=sys.stderr)
        return 2
    if args.data_parallel_size < 1:
        print("lmserve serve: error: --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    if args.responses_store_size < 0 or args.responses_store_ttl_s <= 0:
        print("lmserve serve: error: --responses-store-size must be >= 0 and --responses-store-ttl-s > 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.in_process_engine and (args.data_parallel_size > 1 or args.distributed_executor_backend != "mp"):
        print("lmserve serve: error: --in-process-engine runs one engine thread (no data parallel, no Ray)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.disaggregation is not None:
        from lmserve.engine.pd_client import parse_disaggregation

        try:
            num_prefill, num_decode = parse_disaggregation(args.disaggregation)
        except ValueError as e:
            print(f"lmserve serve: error: --{e}", file=sys.stderr)
            return 2
        if args.in_process_engine or args.data_parallel_size > 1 or args.kv_transfer_config is not None:
            print("lmserve serve: error: --disaggregation sets its own cores and roles: no --in-process-engine, "
                  "--data-parallel-size or --kv-transfer-config with it", file=sys.stderr)  # fmt: skip
            return 2
    if args.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
        print("lmserve serve: error: --distributed-executor-backend ray needs Ray: pip install 'lmserve[ray]'",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        chat_settings = chat_settings_of(args)
    except (ValueError, OSError) as e:
        print(f"lmserve serve: error: {e}", file=sys.stderr)
        return 2
    frontends = []
    if args.grpc_port is not None:
        from lmserve.entrypoints.grpc import missing_grpc

        error = missing_grpc()
        if error is not None:
            print(f"lmserve serve: error: --grpc-port: {error}", file=sys.stderr)
            return 2
        from lmserve.entrypoints.grpc.server import grpc_frontend

        frontends.append(grpc_frontend(args.host, args.grpc_port))
    import torch

    from lmserve.engine.core_client import EngineCoreClient, default_num_threads

    num_cores = args.data_parallel_size if args.disaggregation is None else num_prefill + num_decode
    if args.in_process_engine:
        threads = args.num_threads or torch.get_num_threads()
    else:
        threads = args.num_threads or default_num_threads(num_cores)
    try:  # cheap checks (config files, argument ranges) before binding the port
        config = EngineArgs.from_kwargs(model_path(args), **engine_kwargs(args)).create_engine_config()
    except (ValueError, OSError) as e:
        print(f"lmserve serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model or "lmserve-default"
    try:
        lora_modules = _lora_modules(args, config, name)
    except ValueError as e:
        print(f"lmserve serve: error: {e}", file=sys.stderr)
        return 2
    url = f"http://{_host_for_url(args.host)}:{args.port}"
    server: uvicorn.Server | None = None

    def load() -> AsyncEngine | EngineCoreClient:
        # One OpenMP team per process: libgomp keeps a worker pool per thread that ever ran a parallel
        # region, and with more pooled threads than cores its workers stop spinning between regions, so
        # every short op pays a futex wake-up (measured: a 128-token prefill 185 -> 270 ms on the engine
        # thread). This loading thread therefore runs torch with 1 thread; the engine thread gets them all.
        # With engine-core processes, the API process does no torch compute at all.
        torch.set_num_threads(1)
        try:
            if args.disaggregation is not None:
                from lmserve.engine.pd_client import DisaggregatedClient

                return DisaggregatedClient(
                    config,
                    num_prefill=num_prefill,
                    num_decode=num_decode,
                    kv_lease_s=args.kv_lease_s,
                    kv_load_failure_policy=args.kv_load_failure_policy,
                    backend=args.distributed_executor_backend,
                    num_threads=threads,
                    cpu_policy=args.cpu_wait_policy,
                    max_queued_requests=args.max_queued_requests,
                ).start()
            if not args.in_process_engine:
                return EngineCoreClient(
                    config,
                    data_parallel_size=args.data_parallel_size,
                    backend=args.distributed_executor_backend,
                    num_threads=threads,
                    cpu_policy=args.cpu_wait_policy,
                    max_queued_requests=args.max_queued_requests,
                ).start()
            return AsyncEngine(LLMEngine(config), max_queued_requests=args.max_queued_requests, num_threads=threads)
        except BaseException:
            if server is not None:
                server.should_exit = True  # a server that can never serve should not linger
            raise

    def ready(engine: AsyncEngine | EngineCoreClient) -> None:
        c = engine.config
        where = "in-process engine thread" if args.in_process_engine else (
            f"{args.data_parallel_size} engine core(s) ({args.distributed_executor_backend})")
        if args.disaggregation is not None:
            where = f"{num_prefill} prefill + {num_decode} decode engine cores ({args.distributed_executor_backend})"
        logger.info(
            "serving %r (%s) dtype=%s device=%s KV pool %s %d blocks × %d = %d tokens (%s, %s/token) "
            "max_model_len=%d (%d concurrent) on %s × %d thread(s) at %s",
            name, c.model.path, c.model.dtype, c.device, c.cache.kv_cache_dtype, c.cache.num_blocks,
            c.cache.block_size, c.cache.num_tokens, format_bytes(c.cache.pool_bytes),
            format_bytes(c.cache.kv_bytes_per_token), c.scheduler.max_model_len,
            c.cache.max_concurrent_requests(c.scheduler.max_model_len), where, threads, url,
        )  # fmt: skip

    app = build_app(
        load,
        served_model_name=name,
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        on_ready=ready,
        frontends=frontends,
        lora_modules=lora_modules,
        chat_settings=chat_settings,
        response_store=ResponseStore(args.responses_store_size, args.responses_store_ttl_s),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=5,
            loop="asyncio" if frontends else "auto",  # grpc.aio supports asyncio's own loop, not uvloop
        )
    )
    server.run()
    if app.state.lmserve.load_error is not None:
        return 1
    return 0


def chat_settings_of(args: argparse.Namespace):
    """ChatSettings from the flags; ValueError (an unknown parser lists the known ones) or OSError (the template)."""
    import json

    from lmserve.parsers.chat_settings import ChatSettings

    template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    kwargs = {}
    if args.default_chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"--default-chat-template-kwargs: not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
    try:
        return ChatSettings(args.reasoning_parser, args.tool_call_parser, template, kwargs)
    except ValueError as e:
        flag = "--reasoning-parser" if "reasoning" in str(e) else "--tool-call-parser"
        raise ValueError(f"{flag}: {e}") from None


def _lora_modules(args: argparse.Namespace, config, name: str):
    """--lora-modules validated against the base model (LoRAModules), or None without --enable-lora."""
    if config.lora is None:
        if args.lora_modules or args.enable_lora_runtime_updates:
            raise ValueError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
        return None
    from lmserve.entrypoints.openai.lora_modules import LoRAModules, parse_lora_modules

    modules = LoRAModules(config.model, config.lora.max_lora_rank, name, args.enable_lora_runtime_updates)
    for lora_name, path in parse_lora_modules(args.lora_modules):
        modules.load(lora_name, path)
    return modules


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
