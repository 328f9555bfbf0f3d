"""`deepspeed-bnb` (also `python -m deepspeed_bnb_tools`; both install nothing in DeepSpeed): inspect, reshape,
export, convert and migrate checkpoints offline; check the fused kernels on this machine; run a command with
deepspeed_bnb active in its processes."""

import argparse
import contextlib
import json
import sys
import traceback


def _inspect(args):
    from deepspeed_bnb.checkpoint.tools.summary import summary
    print(summary(args.checkpoint, verify_checksums=args.verify))


def _reshape(args):
    from deepspeed_bnb.checkpoint.tools.reshape import reshape
    written = reshape(args.checkpoint, args.out, args.dp, progress=not args.quiet, stage=args.stage,
                      allow_large_dp=args.allow_large_dp)
    print(f"wrote {written} for {args.dp} ranks" + (f" at ZeRO stage {args.stage}" if args.stage else ""))


def _migrate(args):
    from deepspeed_bnb.checkpoint.tools.reshape import migrate
    print(f"wrote {migrate(args.checkpoint, args.out, progress=not args.quiet)} in the current checkpoint format")


def _export(args):
    from deepspeed_bnb.checkpoint.tools.export import export
    for kind, path in export(args.checkpoint, args.out, args.optimizer_state, progress=not args.quiet,
                             universal=args.universal, stock=args.stock).items():
        print(f"{kind:>12}: {path}")


def _convert(args):
    if args.from_bnb:
        from deepspeed_bnb.checkpoint.tools.from_bnb import convert_from_bnb
        if args.weights is None:
            raise ValueError("convert --from-bnb needs --weights FILE: the model's state dict (torch or safetensors)")
        if args.to == "32bit":
            raise ValueError("convert --from-bnb carries the bnb state over as it is; convert the result with --to "
                             "32bit afterwards")
        names = None
        if args.param_names:
            with open(args.param_names) as f:
                names = [line.strip() for line in f if line.strip()]
        print(convert_from_bnb(args.checkpoint, args.weights, args.out,
                               args.optimizer_class or "bitsandbytes.optim.adamw.AdamW8bit", names, args.dp or 1,
                               args.stage or 2, progress=not args.quiet, optimizer_key=args.optimizer_key,
                               model_key=args.model_key, allow_large_dp=args.allow_large_dp))
        return
    if args.weights or args.param_names:
        raise ValueError("convert: --weights and --param-names go with --from-bnb")
    if args.to is None and args.master_weights is None:
        raise ValueError("convert needs --to 8bit or --to 32bit, --master-weights fp32|bf16|bf16+8, or --from-bnb")
    from deepspeed_bnb.checkpoint.tools.convert import convert, switch_master_weights
    if args.to is None:
        print(switch_master_weights(args.checkpoint, args.out, args.master_weights, progress=not args.quiet))
        return
    fp32_names = [name for name in (args.fp32_params or "").split(",") if name]
    report = convert(args.checkpoint, args.out, args.to, optimizer_class=args.optimizer_class,
                     min_8bit_size=args.min_8bit_size, progress=not args.quiet, dp=args.dp, stage=args.stage,
                     allow_large_dp=args.allow_large_dp, master_mode=args.master_weights,
                     param_groups=_param_groups(args.param_groups),
                     eight_bit_by_name={name: False for name in fp32_names} or None)
    print(report)


def _param_groups(text):
    """--param-groups: a JSON list of objects (each param group's hyper-parameters), or None."""
    if text is None:
        return None
    try:
        groups = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"convert: --param-groups is not JSON ({exc}); give a list of objects, one per param group, "
                         f"e.g. '[{{\"lr\": 1e-4, \"weight_decay\": 0.1}}]'") from None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"convert: --param-groups must be a JSON list of objects, one per param group; got {text!r}")
    return groups


def _run(args):
    from deepspeed_bnb.launch.wrapper import COMMAND_NOT_FOUND, CommandNotFound, run
    try:
        run(args.argv)  # replaces this process: returns only on an error
    except CommandNotFound as exc:
        print(exc, file=sys.stderr)
        return COMMAND_NOT_FOUND
    except ImportError as exc:  # an untested release (UnsupportedVersionError): nothing started
        print(f"deepspeed-bnb run: {exc}", file=sys.stderr)
        return 2


def _checkable_device(name: str) -> str:
    """`name` if this machine has that device (cpu, or a CUDA GPU it can see), else ValueError naming it and the fix."""
    import torch
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a device name ({exc}); use cpu, cuda or cuda:N") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise ValueError(f"--device {name!r}: this machine sees {gpus} CUDA GPU(s); use cpu"
                         + (f" or cuda:0..cuda:{gpus - 1}" if gpus else ""))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: the fused kernels exist for cpu and cuda only")
    return name


def _kernels(args):
    import torch

    from deepspeed_bnb.ops import cpu_features, loader, rules, self_check
    from deepspeed_bnb.optim.fused.route import cpu32_choice
    devices = [_checkable_device(d) for d in args.device] if args.device else \
        ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if not loader.load():
        print(f"fused kernels: not built ({loader.error()}); training steps with bitsandbytes' own update")
        return 1
    needs = loader.compiled_for()
    print(f"fused kernels: {loader.source()} build, CPU "
          f"{cpu_features.kernel_path(needs) if needs is not None else 'path unknown (no instruction-set record)'}")
    failures = 0
    for device in devices:
        for rule in rules.RULES:
            for master in self_check.MASTERS:
                problem = self_check.disagreement(rule, device, master)
                failures += problem is not None
                print(f"  {device} {rule}, {master} master weights: "
                      + ("same bits as the reference" if problem is None else f"FAILS: {problem}"))
                if problem is None and torch.device(device).type == "cpu":
                    print(f"  {device} {rule}, {master} master weights, 32-bit state: "
                          f"{cpu32_choice(rule, master).why}")
            # the model's bf16 copy the kernel writes beside fp32 master weights (runtime/zero/lp_copy.py)
            problem = self_check.disagreement(rule, device, "fp32", lp_copy=True)
            failures += problem is not None
            when = "" if torch.device(device).type == "cpu" else " (written under DEEPSPEED_BNB_KERNEL_LP_COPY=gpu)"
            print(f"  {device} {rule}, the model's bf16 copy{when}: "
                  + ("same bits as torch's conversion" if problem is None else f"FAILS: {problem}"))
    return 1 if failures else 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="deepspeed-bnb", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, func, help_text):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("checkpoint", help="checkpoint directory (follows its 'latest' file) or a tag directory")
        sub.add_argument("--trust", action="store_true",
                         help="read the checkpoint with full pickle and without a manifest, for checkpoints you trust "
                              "(sets DEEPSPEED_BNB_TRUST_CHECKPOINTS=1); by default files are read by the safe loader "
                              "and must match their manifest")
        sub.set_defaults(func=func)
        return sub

    inspect = command("inspect", _inspect, "print stage, DP size, optimizer, hyper-parameters, per-parameter "
                                           "precision, state keys and their classes, file sizes, format version")
    inspect.add_argument("--verify", action="store_true", help="also check every file's SHA-256 (reads them all)")

    for name, func, text in (("reshape", _reshape, "rewrite the checkpoint for another data-parallel size"),
                             ("export", _export, "write consolidated fp32 weights as safetensors (optionally the "
                                                 "optimizer state, dequantized, under torch's names)"),
                             ("convert", _convert, "switch optimizer-state precision: 32-bit (torch/DeepSpeed AdamW, "
                                                   "bnb 32-bit; ZeRO-1/2/3 or universal checkpoints) <-> bnb 8-bit; "
                                                   "also a stock DeepSpeed run of a bnb optimizer into deepspeed_bnb's "
                                                   "layout (Adam's, AdEMAMix's, Lion's, SGD's, RMSprop's or "
                                                   "Adagrad's state); reports the round-trip error"),
                             ("migrate", _migrate, "rewrite a deepspeed_bnb checkpoint of an older format in the "
                                                   "current one (per-tensor checksums; with --trust, one that needs "
                                                   "trust or lost its manifest)")):
        sub = command(name, func, text)
        sub.add_argument("out", help="output directory (a checkpoint directory for reshape/convert)")
        sub.add_argument("--quiet", action="store_true", help="no progress bars")
    commands.choices["reshape"].add_argument("--dp", type=int, required=True,
                                             help="data-parallel size to write the checkpoint for")
    commands.choices["reshape"].add_argument("--stage", type=int, choices=(1, 2, 3), default=None,
                                             help="ZeRO stage to write the files of (default: the checkpoint's)")
    for name in ("reshape", "convert"):
        commands.choices[name].add_argument("--allow-large-dp", action="store_true",
                                            help="allow --dp above 4096 (one file per rank)")
    commands.choices["export"].add_argument("--optimizer-state", action="store_true",
                                            help="also write optimizer.safetensors (fp32 state per parameter, e.g. "
                                                 "<name>.exp_avg, <name>.exp_avg_sq, <name>.step) and "
                                                 "optimizer.json (hyper-parameters)")
    commands.choices["export"].add_argument("--universal", action="store_true",
                                            help="write a DeepSpeed universal checkpoint instead (OUT/<tag>/zero/..., "
                                                 "OUT/latest_universal): fp32 weights and every parameter's bnb "
                                                 "state as it is (8-bit codes, block scales, the maps once), for "
                                                 "an engine of deepspeed_bnb at any layout")
    commands.choices["export"].add_argument("--stock", action="store_true",
                                            help="with --universal: torch AdamW's fp32 state (exp_avg, exp_avg_sq, "
                                                 "step) instead, which a stock engine loads with "
                                                 '"checkpoint": {"load_universal": true}')
    kernels = commands.add_parser("kernels", help="check the compiled fused kernels against their reference here "
                                                  "(the first-use check the optimizer runs); exit 1 if one fails",
                                  description="Load (or JIT-build) the fused kernels, say which build and CPU path "
                                              "run, and check every rule on each device bit for bit against the "
                                              "pure-torch reference.")
    kernels.add_argument("--device", action="append", help="device to check (repeatable; default: cpu and every GPU)")
    kernels.set_defaults(func=_kernels)
    run = commands.add_parser("run", help="run a command (a launcher, a framework's CLI, a script) with deepspeed_bnb "
                                          "active in every Python process it starts, without editing it",
                              description="Run COMMAND with deepspeed_bnb activated in each of its Python processes "
                                          "(every rank a launcher starts) as soon as it imports DeepSpeed, e.g. "
                                          "deepspeed-bnb run -- llamafactory-cli train config.yaml. See "
                                          "docs/clients.md.")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="the command and its arguments (after --)")
    run.set_defaults(func=_run)
    convert = commands.choices["convert"]
    convert.add_argument("--to", choices=("8bit", "32bit"), default=None, help="state precision to write")
    convert.add_argument("--master-weights", default=None, metavar="MODE",
                         help="master weights to write: fp32, bf16 or bf16+8 (compensated); alone it keeps the "
                              "optimizer state as it is, and reports how many weights the switch rounded")
    convert.add_argument("--from-bnb", action="store_true",
                         help="CHECKPOINT is a torch file with a plain bitsandbytes optimizer.state_dict() (either "
                              "layout: bitsandbytes < 0.49.2 or >= 0.49.2), bare or under 'optimizer'; written as a "
                              "deepspeed_bnb checkpoint with the state unchanged")
    convert.add_argument("--weights", default=None,
                         help="with --from-bnb: the model's state dict (torch .pt, bare or under 'model', or "
                              ".safetensors); its names name the optimizer's parameters, in order")
    convert.add_argument("--param-names", default=None,
                         help="with --from-bnb: a file with one parameter name per line, in the order the optimizer "
                              "got them (needed when the weights also hold buffers or tied weights)")
    convert.add_argument("--optimizer-key", default=None, help="with --from-bnb: the entry of CHECKPOINT holding "
                                                               "the optimizer state dict")
    convert.add_argument("--model-key", default=None, help="with --from-bnb: the entry of --weights holding the "
                                                           "model state dict")
    convert.add_argument("--dp", type=int, default=None, help="with --from-bnb or a universal checkpoint: "
                                                              "data-parallel size to write for (default 1; it loads "
                                                              "at any)")
    convert.add_argument("--stage", type=int, choices=(1, 2, 3), default=None,
                         help="with --from-bnb or a universal checkpoint: ZeRO stage of the files (default 2; it "
                              "loads into any)")
    convert.add_argument("--optimizer-class", default=None,
                         help="bnb optimizer class the converted checkpoint is for (default: "
                              "bitsandbytes.optim.adamw.AdamW8bit for --to 8bit, bitsandbytes.optim.adamw.AdamW for "
                              "--to 32bit); build the engine with the same class. Its update rule says which state "
                              "the source must hold: for a run of bnb's Lion8bit give bitsandbytes.optim.Lion8bit")
    convert.add_argument("--param-groups", default=None, metavar="JSON",
                         help="each param group's hyper-parameters as a JSON list of objects, in the run's order, for "
                              "an elastic stock ZeRO-1/2 checkpoint (elastic_checkpoint: true keeps none), e.g. "
                              "'[{\"lr\": 1e-4, \"weight_decay\": 0.1}, {\"lr\": 1e-4, \"weight_decay\": 0.0}]'")
    convert.add_argument("--32bit-params", dest="fp32_params", default=None, metavar="NAME,...",
                         help="with --to 8bit: parameters that keep 32-bit state whatever their size, as a bnb "
                              "override (GlobalOptimManager, optim_bits 32) keeps them; HF Trainer registers one for "
                              "every nn.Embedding's weight with its 8-bit optimizers")
    convert.add_argument("--min-8bit-size", type=int, default=4096,
                         help="with --to 8bit: parameters with fewer elements keep fp32 state, as bnb does "
                              "(default 4096; use the min_8bit_size the new optimizer is built with)")
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError, CheckpointSaveError
    from deepspeed_bnb.checkpoint.format.safe_load import trusting
    try:
        with trusting() if getattr(args, "trust", False) else contextlib.nullcontext():  # this call only
            code = args.func(args)
    except (CheckpointMismatchError, CheckpointSaveError, ValueError, OSError) as exc:
        print(f"deepspeed-bnb {args.command}: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # input the checks above did not foresee
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"deepspeed-bnb {args.command}: {getattr(args, 'checkpoint', '')} is malformed in a way deepspeed-bnb "
              f"does not check for ({type(exc).__name__}: {exc}, at {where.filename}:{where.lineno}); nothing was "
              f"written. Please report it.", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
