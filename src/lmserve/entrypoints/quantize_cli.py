"""`lmserve quantize --model DIR --out DIR8 --method int8|int4`: write a pre-quantized checkpoint.

The output (lmserve.model.quantization's format: safetensors + `quantization_config` in config.json)
loads with no flag and skips the quantization work at start-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write an int8 / int4 quantized copy of a model")
    p.add_argument("--model", required=True, help="HF model directory (float weights)")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--method", required=True, choices=["int8", "int4"])
    p.add_argument("--group-size", type=int, default=32, help="int4: inputs per scale (default 32)")
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from lmserve.config.engine import EngineArgs, checkpoint_quantization
    from lmserve.model.layers import quantize_linear_weights
    from lmserve.model.loader import load_model
    from lmserve.model.quantization import write_quantized_checkpoint

    src, out = Path(args.model), Path(args.out)
    try:
        if checkpoint_quantization(src) is not None:
            raise ValueError(f"--model {str(src)!r} is already quantized")
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"--out {str(out)!r} exists and is not empty")
        engine_args = EngineArgs(
            str(src), quantization=args.method, quantization_group_size=args.group_size, num_kv_blocks=1
        )
        cfg = engine_args.create_engine_config()
        model = load_model(cfg.model, cfg.scheduler.max_model_len, "cpu")
        quantize_linear_weights(model, cfg.quantization)
        size = write_quantized_checkpoint(model, src, out, cfg.quantization)
    except ValueError as e:
        print(f"lmserve quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'model.safetensors'} ({size / 2**20:.1f} MiB, {args.method})")
    return 0
