"""`lmserve generate [--model DIR] "prompt" ...`: print completions."""

from __future__ import annotations

import argparse
import sys

from lmserve.config.args import add_engine_args, engine_kwargs, model_path

DEFAULT_PROMPTS = ["ROMEO:", "床前明月光"]


CLI_SAMPLING_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 0}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_PROMPTS})")
    p.add_argument("--max-tokens", type=int, default=64)
    # unset: the model's generation_config.json value (--generation-config auto), else 0.8 / 0.95 / 0
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import json

    from lmserve.llm import LLM
    from lmserve.sampling_params import SamplingParams

    try:
        llm = LLM(model_path(args), **engine_kwargs(args))
        chosen = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        sampling = {**CLI_SAMPLING_DEFAULTS, **llm.engine.generation_defaults}
        sampling.update({k: v for k, v in chosen.items() if v is not None})
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            **sampling,
        )
        outputs = llm.generate(args.prompts or DEFAULT_PROMPTS, params, use_tqdm=False)
    except ValueError as e:
        print(f"lmserve generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {
                    "prompt": out.prompt,
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": str(c.finish_reason),
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(f"--- {out.prompt!r} [{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens)")
                print(out.prompt + c.text)
    return 0
