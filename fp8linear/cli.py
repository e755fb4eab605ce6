"""The `fp8linear` command: quantize, info, demo, build.

Errors are one line on stderr, never a traceback: exit status 2 for bad input, 1 when
`info` finds an inconsistent checkpoint, 130 on Ctrl-C, 141 when the reader of stdout goes
away (`fp8linear demo --json | head`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


def _quantize(args) -> int:
    from .checkpoint import quantize_checkpoint
    report = quantize_checkpoint(args.in_dir, args.out_dir, skip=args.skip or (),
                                 ue8m0=args.ue8m0, force=args.force,
                                 progress=not args.quiet)
    print(report.summary())
    return 0


def _info(args) -> int:
    from .checkpoint import checkpoint_info, format_checkpoint_info
    info = checkpoint_info(args.dir)
    print(json.dumps(info, indent=2) if args.json else format_checkpoint_info(info))
    problems = info["problems"]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"fp8linear info: error: {problems[0]}{more}", file=sys.stderr)
        return 1
    return 0


def _demo(args) -> int:
    import dataclasses

    import torch

    from .demo import CUDA_CONFIG, DemoConfig, format_report, run_demo
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"--device {args.device}: no CUDA device is available (torch "
                         f"{torch.__version__}, {build}); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {args.device}: there are only "
                         f"{torch.cuda.device_count()} CUDA devices")
    # a copy: --seed / --layers must not change the module-level CUDA_CONFIG
    cfg = dataclasses.replace(CUDA_CONFIG) if device.type == "cuda" else DemoConfig()
    if args.seed is not None:
        cfg.seed = args.seed
    if args.layers is not None:
        cfg.num_layers = args.layers
    result = run_demo(cfg, device=device)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def _build(args) -> int:
    from .backends.sm90.build import BuildError, precompile
    try:
        path, compiled = precompile(verbose=args.verbose)
    except BuildError as e:  # no toolkit or a compile error (with its log)
        print(f"fp8linear build: error: {e}", file=sys.stderr)
        return 1
    if compiled:
        print(f"fp8linear build: kernels compiled into {path}")
    else:
        print(f"fp8linear build: nothing to compile, the kernels are ready: {path}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**63 - 1:  # torch's generator takes 64 bits; the demo uses seed + 1
        raise argparse.ArgumentTypeError(f"expected 0 to {2**63 - 2}, got {value}")
    return value


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8linear", description=(
        "Block-scaled FP8 (DeepSeek-V3 128x128) linear layers: convert checkpoints, inspect "
        "them, run the demo, build the CUDA kernels."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("quantize", help="convert a bf16/fp16/fp32 safetensors checkpoint "
                                        "to block FP8, shard by shard")
    q.add_argument("in_dir", metavar="IN_DIR")
    q.add_argument("out_dir", metavar="OUT_DIR")
    q.add_argument("--skip", action="append", metavar="PATTERN",
                   help="leave tensors whose name contains PATTERN (or matches it as a glob) "
                        "in high precision; repeatable")
    q.add_argument("--ue8m0", action="store_true",
                   help="power-of-two scales (DeepSeek-V3.1's scale_fmt ue8m0)")
    q.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if it holds only a checkpoint fp8linear wrote")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=_quantize)

    i = sub.add_parser("info", help="what a checkpoint directory holds; exits 1 when its fp8 "
                                    "weights and scales do not fit together")
    i.add_argument("dir", metavar="DIR")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=_info)

    d = sub.add_parser("demo", help="quantize a small random Llama-style model and compare "
                                    "it with the original (no downloads)")
    d.add_argument("--device", type=_device,
                   help="cpu, cuda or cuda:N (default: cuda when available)")
    d.add_argument("--seed", type=_seed)
    d.add_argument("--layers", type=_positive_int, help="number of transformer layers")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_demo)

    b = sub.add_parser("build", help="compile the CUDA kernels now instead of on first use "
                       "(nothing to do where a prebuilt library matches the sources)")
    b.add_argument("--verbose", action="store_true", help="print the compiler's output")
    b.set_defaults(func=_build)
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    from .checkpoint import CheckpointError, CheckpointWarning
    plain = warnings.showwarning

    def one_line(message, category, *rest, **kw):
        if issubclass(category, CheckpointWarning):
            print(f"fp8linear {args.command}: warning: {message}", file=sys.stderr)
        else:
            plain(message, category, *rest, **kw)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            rc = args.func(args)
            sys.stdout.flush()  # here, so that a closed pipe is caught below
            return rc
    except KeyboardInterrupt:  # the converter has removed its temporary folder by now
        print(f"fp8linear {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly; point stdout at /dev/null so that
        # the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"fp8linear {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
