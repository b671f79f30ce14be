"""The ``dpzero`` command line.

``dpzero privacy --noise-multiplier S --sampling-rate Q --steps N --delta D`` prints epsilon;
``dpzero privacy --epsilon E --sampling-rate Q --steps N --delta D`` prints the noise multiplier that reaches it.
``dpzero audit [train flags] [--canaries M ...]`` audits one such run (:mod:`dpzero_jax.audit`).
``dpzero train [flags]`` runs DP training (defaults: MLP on scikit-learn digits at epsilon 3; ``--model hf:PATH
--task causal-lm|classification --data FILE`` fine-tunes a Hugging Face checkpoint on text); ``--config FILE``
(JSON or YAML, keys as in ``dpzero_jax.train.TrainConfig``) sets defaults that flags override.
Bad values get a one-line error that names the flag.
"""

from __future__ import annotations

import argparse
import math
import sys

from dpzero_jax import planner


def _positive_float(flag: str, allow_zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{flag} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
        return value
    return parse


def _unit_interval(flag: str, closed_right: bool):
    def parse(text: str) -> float:
        value = _positive_float(flag)(text)
        if value > 1 or (value == 1 and not closed_right):
            raise argparse.ArgumentTypeError(f"{flag} must be in (0, {'1]' if closed_right else '1)'}, got {text!r}")
        return value
    return parse


def _non_negative_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {text!r}")
        return value
    return parse


def build_parser(train_flags: bool = True) -> argparse.ArgumentParser:
    """The ``dpzero`` parser. ``train_flags=False`` registers ``train`` without its flags: they come from
    ``TrainConfig`` and import JAX, which ``dpzero privacy`` and ``dpzero plan`` never need."""
    parser = argparse.ArgumentParser(prog="dpzero", description="Differentially private training in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    privacy = commands.add_parser("privacy", help="epsilon of a DP-SGD run, or sigma for a target epsilon")
    target = privacy.add_mutually_exclusive_group(required=True)
    target.add_argument("--noise-multiplier", type=_positive_float("--noise-multiplier", allow_zero=True),
                        help="sigma: print the epsilon it gives")
    target.add_argument("--epsilon", type=_positive_float("--epsilon"), help="target epsilon: print the sigma")
    privacy.add_argument("--sampling-rate", type=_unit_interval("--sampling-rate", closed_right=True), required=True,
                         help="Poisson sampling rate q = expected batch size / dataset size")
    privacy.add_argument("--steps", type=_non_negative_int("--steps"), required=True, help="number of noisy steps")
    privacy.add_argument("--delta", type=_unit_interval("--delta", closed_right=False), default=1e-5)
    privacy.add_argument("--accountant", choices=("pld", "rdp"), default="pld")
    privacy.add_argument("--dataset-size", type=_positive_int("--dataset-size"),
                         help="N: also size the Poisson batch cap as `dpzero train` does and include the charge "
                              "for truncated batches (q * N is the expected batch)")
    _add_train_parser(commands, train_flags)
    _add_audit_parser(commands, train_flags)
    planner.add_parser(commands)
    return parser


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 1:   # one message for 0 and for negative values
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {text!r}")
        return value
    return parse


def _groups(text: str):
    if text in ("all-layer", "layer-wise", "param-wise"):
        return text
    if text.startswith("uniform:"):
        return ("uniform", _positive_int("--groups uniform:K")(text.split(":", 1)[1]))
    raise argparse.ArgumentTypeError(
        f"--groups must be all-layer, layer-wise, param-wise or uniform:K, got {text!r}")


def _mesh(flag: str):
    def parse(text: str) -> str:
        from dpzero_jax.sharding import parse_mesh

        try:
            parse_mesh(text, flag)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    return parse


def _patterns(flag: str):
    def parse(text: str) -> tuple[str, ...]:
        if text.strip().lower() == "none":
            return ()
        items = tuple(item.strip() for item in text.split(","))
        if not all(items):
            raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated path patterns, got {text!r}")
        return items
    return parse


def _model(text: str) -> str:
    if text in ("mlp", "vit", "cnn") or (text.startswith("hf:") and text[3:].strip()):
        return text
    raise argparse.ArgumentTypeError(f"--model must be mlp, vit, cnn or hf:PATH, got {text!r}")


def _hidden(text: str):
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated positive ints, got {text!r}")
    return widths


def _add_train_parser(commands, with_flags: bool = True, name: str = "train",
                      help: str = "train a model with DP-SGD (default: MLP on digits, epsilon 3)",
                      resumable: bool = True):
    # every default is None (SUPPRESS): unset flags fall back to --config, then to TrainConfig's defaults
    train = commands.add_parser(name, help=help, argument_default=argparse.SUPPRESS)
    if not with_flags:
        return train
    from dpzero_jax.config import MODES
    from dpzero_jax.models.gpt2 import REMAT

    train.add_argument("--config", help="JSON or YAML file of TrainConfig options (flags override it)")
    train.add_argument("--model", type=_model,
                       help="mlp, vit, cnn, or hf:PATH (a Hugging Face save_pretrained directory: GPT-2, Llama, "
                            "Mistral, Qwen2, Gemma 1 / 2, BERT, RoBERTa, ViT)")
    train.add_argument("--task", choices=("classification", "causal-lm"),
                       help="classification (default) or causal-lm (hf:PATH GPT-2 checkpoints)")
    train.add_argument("--data", help="text data for hf:PATH models: a .txt (causal-lm: one corpus cut into "
                                      "max-length windows) or .jsonl file (one example per line); default: the "
                                      "embedded Python help-topics corpus")
    train.add_argument("--eval-data", help="held-out .txt/.jsonl file (default: 10%% of --data, fixed)")
    train.add_argument("--max-length", type=_positive_int("--max-length"),
                       help="tokens per example (default: the model's positions, at most 128)")
    train.add_argument("--text-field", help="JSONL field holding the text (default text)")
    train.add_argument("--label-field", help="JSONL field holding the class (default label)")
    train.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's)")
    train.add_argument("--export", help="write the trained model here (a directory or gs:// URL) in Hugging Face "
                                        "save_pretrained format")
    train.add_argument("--scan-layers", action="store_true",
                       help="GPT-2 (--task causal-lm): stack the blocks and scan over them (compile time independent "
                            "of depth)")
    train.add_argument("--remat", choices=REMAT,
                       help="scanned decoders (--task causal-lm): what each block's backward recomputes: none (keep "
                            "every activation; default), block (only the block's input kept: least memory), dots (the "
                            "projections' outputs kept, the rest recomputed)")
    train.add_argument("--dataset", choices=("digits",))
    train.add_argument("--hidden", type=_hidden, help="MLP hidden widths, e.g. 128 or 256,128")
    length = train.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int("--steps"), help="number of steps (default: from --epochs)")
    length.add_argument("--epochs", type=_positive_float("--epochs"), help="steps = ceil(epochs / q)")
    train.add_argument("--batch-size", type=_positive_int("--batch-size"), help="expected (Poisson) batch size")
    train.add_argument("--micro-batch-size", type=_positive_int("--micro-batch-size"),
                       help="physical chunk size (gradient accumulation; noise once per logical batch)")
    privacy = train.add_mutually_exclusive_group()
    privacy.add_argument("--epsilon", type=_positive_float("--epsilon"), help="target epsilon (sigma calibrated)")
    privacy.add_argument("--noise-multiplier", type=_positive_float("--noise-multiplier", allow_zero=True))
    privacy.add_argument("--no-dp", action="store_true", help="non-private baseline (same sampling and steps)")
    train.add_argument("--delta", type=_unit_interval("--delta", closed_right=False))
    train.add_argument("--accountant", choices=("pld", "rdp"))
    train.add_argument("--max-grad-norm", type=_positive_float("--max-grad-norm"))
    train.add_argument("--clip-fn", choices=("abadi", "automatic", "global"))
    train.add_argument("--groups", type=_groups, help="all-layer, layer-wise, param-wise or uniform:K")
    train.add_argument("--clip-quantile", type=_unit_interval("--clip-quantile", closed_right=False),
                       help="adaptive clipping (Andrew et al. 2021): every step each group's threshold moves "
                            "toward this quantile of its per-example gradient norms, from a noised count of "
                            "unclipped examples; --max-grad-norm is then the initial threshold (default: fixed "
                            "thresholds). The count's noise is paid from the same privacy budget (same epsilon; "
                            "the gradient's noise multiplier grows slightly: docs/privacy.md)")
    train.add_argument("--clip-lr", type=_positive_float("--clip-lr"),
                       help="adaptive clipping's learning rate eta: C <- C * exp(-eta (unclipped fraction - "
                            "quantile))")
    train.add_argument("--clip-count-noise", type=_positive_float("--clip-count-noise"),
                       help="adaptive clipping: std sigma_b of the noise on each group's count of unclipped "
                            "examples (default: expected batch size / 20, as in the paper); must exceed "
                            "sigma * sqrt(groups) / 2")
    train.add_argument("--mode", choices=MODES)
    train.add_argument("--norm-kernel", choices=("auto", "xla", "pallas"),
                       help="per-example norms with XLA einsums or the tiled Pallas kernels (auto: xla for now)")
    train.add_argument("--lr", type=_positive_float("--lr"), help="the (peak) learning rate")
    train.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"),
                       help="after the warmup: constant, or cosine / linear decay to 0 at the last step")
    train.add_argument("--warmup-steps", type=_non_negative_int("--warmup-steps"),
                       help="linear warmup: lr * (t + 1) / N for the first N steps (default 0)")
    train.add_argument("--optimizer", choices=("adam", "sgd", "adamw"))
    train.add_argument("--weight-decay", type=_positive_float("--weight-decay", allow_zero=True))
    train.add_argument("--seed", type=_non_negative_int("--seed"))
    train.add_argument("--out", help="output directory or gs:// (s3://, ...) URL (metrics.jsonl, training.png, "
                                     "checkpoints/)")
    train.add_argument("--log-every", type=_positive_int("--log-every"))
    train.add_argument("--tensorboard", action="store_true",
                       help="also write the metric rows as TensorBoard event files under OUT/tensorboard "
                            "(pip install 'dpzero_jax[tensorboard]')")
    train.add_argument("--wandb", dest="wandb_project", metavar="PROJECT",
                       help="also log the metric rows to this Weights & Biases project (wandb installed, logged in)")
    train.add_argument("--checkpoint-every", type=_non_negative_int("--checkpoint-every"), help="0: never")
    train.add_argument("--keep-checkpoints", type=_positive_int("--keep-checkpoints"))
    train.add_argument("--eval-every", type=_non_negative_int("--eval-every"),
                       help="test-set evaluation every N steps (0: only at the end)")
    train.add_argument("--sampling", choices=("poisson", "fixed-size", "shuffled"),
                       help="poisson (default), fixed-size (needs --accountant rdp) or shuffled (no formal guarantee)")
    train.add_argument("--devices", type=_positive_int("--devices"),
                       help="train over N devices, ZeRO-sharded (N virtual CPU devices without an accelerator)")
    train.add_argument("--mesh", type=_mesh("--mesh"),
                       help="device mesh, e.g. data=2,fsdp=4 (default with --devices N: fsdp=N)")
    train.add_argument("--dcn-mesh", type=_mesh("--dcn-mesh"),
                       help="multi-slice runs: slices each --mesh axis spans over the data-centre network, e.g. "
                            "data=2 (a hybrid ICI x DCN mesh; without a TPU slice_index a slice is a run of "
                            "consecutive devices)")
    train.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage (default 3)")
    train.add_argument("--strategy", choices=("gspmd", "explicit"),
                       help="gspmd: one jit with shardings (default); explicit: shard_map with all-gather / "
                            "reduce-scatter written out")
    cluster = train.add_argument_group("multi-host (every process runs the same command)")
    cluster.add_argument("--distributed", action="store_true",
                         help="initialise jax.distributed, detecting SLURM / Open MPI / TPU pod settings")
    cluster.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and --process-id)")
    cluster.add_argument("--num-processes", type=_positive_int("--num-processes"))
    cluster.add_argument("--process-id", type=_non_negative_int("--process-id"))
    train.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                       help="compute precision; fp32 master weights, norms and noise; no loss scaling")
    train.add_argument("--peft", choices=("none", "lora", "bitfit", "linear-probe"),
                       help="parameter-efficient fine-tuning: which parameters train (default none: all)")
    train.add_argument("--lora-rank", type=_positive_int("--lora-rank"), help="LoRA rank (default 8)")
    train.add_argument("--lora-alpha", type=_positive_float("--lora-alpha"), help="LoRA alpha (default 16)")
    train.add_argument("--lora-targets", type=_patterns("--lora-targets"),
                       help="comma-separated path patterns of the dense layers that get adapters")
    train.add_argument("--peft-also-train", type=_patterns("--peft-also-train"),
                       help="comma-separated patterns trained in full besides the PEFT method's (default: head for "
                            "lora/bitfit); 'none' for nothing")
    train.add_argument("--rmm", choices=("none", "gaussian", "rademacher", "dct", "dft"),
                       help="randomized-matmul dense layers (paper 002; every dense layer with a trainable kernel "
                            "except the head): the sketch; dft is the discrete Hartley transform (the real "
                            "orthogonal transform computed by an FFT), dct the DCT-II; default none")
    train.add_argument("--rmm-rate", type=_unit_interval("--rmm-rate", closed_right=True),
                       help="RMM compression rate rho in (0, 1]: the fraction of each layer input kept for the "
                            "backward pass (per example its tokens under DP; the batch's rows with --no-dp)")
    train.add_argument("--rmm-diagnostics-every", type=_non_negative_int("--rmm-diagnostics-every"),
                       help="log D2_SGD, D2_RMM and alpha of each RMM layer every N steps (0: never)")
    resume = train.add_mutually_exclusive_group() if resumable else None   # an audit is one fresh run
    if resume is not None:
        resume.add_argument("--resume", action="store_true",
                            help="continue from the latest checkpoint in --out (an error if there is none)")
        resume.add_argument("--resume-or-start", action="store_true",
                            help="resume if --out holds a checkpoint, else start a new run there")
    train.add_argument("--allow-large-delta", action="store_true",
                       help="accept delta above 1/n (n training examples); recorded in the summary")
    train.add_argument("--no-progress", dest="progress", action="store_false")
    _show_defaults(train)
    return train


def _add_audit_parser(commands, with_flags: bool = True) -> None:
    """``dpzero audit``: the training flags (the run audited) and the audit's own (:mod:`dpzero_jax.audit`)."""
    audit = _add_train_parser(commands, with_flags, "audit", resumable=False,
                              help="one-run privacy audit of a training configuration: an empirical epsilon lower "
                              "bound from canaries (Steinke, Nasr, Jagielski 2023)")
    if not with_flags:
        return
    group = audit.add_argument_group("audit")
    group.add_argument("--canaries", type=_non_negative_int("--canaries"), default=1000,
                       help="white-box gradient canaries m (default 1000; 0: none)")
    group.add_argument("--input-canaries", type=_non_negative_int("--input-canaries"), default=0,
                       help="black-box input canaries: held-out examples with wrong labels (default 0)")
    group.add_argument("--confidence", type=_unit_interval("--confidence", closed_right=False), default=0.95,
                       help="confidence of the lower bound (default 0.95)")
    group.add_argument("--canary-norm", type=_positive_float("--canary-norm"),
                       help="a gradient canary's norm before clipping, in multiples of the threshold (default 10; "
                            "0.99 with --clip-fn global)")
    group.add_argument("--audit-seed", type=_non_negative_int("--audit-seed"), default=0,
                       help="seed of the canaries' inclusion (default 0)")
    group.add_argument("--json", dest="audit_json", action="store_true",
                       help="print the report as JSON instead of a table (audit.json is written into --out anyway)")


def _show_defaults(parser) -> None:
    """Append TrainConfig's default to each flag's help (the flags themselves default to "not given", so that a
    --config file can fill them)."""
    import dataclasses

    from dpzero_jax.train import TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    for action in parser._actions:
        if action.dest not in defaults or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue
        if action.help and "default" in action.help:
            continue
        value = defaults[action.dest]
        if value is None:   # described in the help itself (e.g. --steps: from --epochs)
            continue
        shown = str(",".join(map(str, value)) if isinstance(value, tuple) else value).replace("%", "%%")
        action.help = f"{action.help or ''} (default: {shown})".strip()


def _privacy(args) -> str:
    from dpzero_jax import accounting

    if args.epsilon is not None:
        sigma = accounting.calibrate_noise(args.epsilon, args.sampling_rate, args.steps, args.delta,
                                           accountant=args.accountant)
        return (f"noise multiplier {sigma:.4f} gives epsilon <= {args.epsilon:g} at delta={args.delta:g} "
                f"(q={args.sampling_rate:g}, {args.steps} steps, {args.accountant.upper()})")
    if args.dataset_size is not None:
        return _privacy_with_cap(args)
    eps = accounting.epsilon(args.noise_multiplier, args.sampling_rate, args.steps, args.delta,
                             accountant=args.accountant)
    return (f"epsilon = {eps:.4f} at delta={args.delta:g} (sigma={args.noise_multiplier:g}, q={args.sampling_rate:g}, "
            f"{args.steps} steps, {args.accountant.upper()})")


def _privacy_with_cap(args) -> str:
    """``dpzero privacy --dataset-size N``: the batch cap `dpzero train` would choose and the epsilon with its
    truncation charge (the same computation as the trainer's, on one device)."""
    from dpzero_jax import accounting
    from dpzero_jax.sampling import PoissonSampler

    share = accounting.TRUNCATION_SHARE
    if args.epsilon is not None:
        sigma = accounting.calibrate_noise(args.epsilon, args.sampling_rate, args.steps, args.delta * (1 - share),
                                           accountant=args.accountant)
        planned = args.epsilon
    else:
        sigma = args.noise_multiplier
        if sigma == 0:
            raise ValueError("--noise-multiplier 0 adds no noise: epsilon is infinite")
        planned = accounting.planned_epsilon(sigma, args.sampling_rate, args.steps, args.delta * (1 - share),
                                             accountant=args.accountant)
    sampler = PoissonSampler.for_privacy_budget(args.dataset_size, args.sampling_rate, args.steps, args.delta, planned)
    ledger = accounting.PrivacyLedger()
    ledger.record(sigma, args.sampling_rate, steps=args.steps, truncation_probability=sampler.truncation_probability)
    eps = ledger.epsilon(args.delta, args.accountant)
    charge = ledger.truncation_mass * (1 + math.exp(min(eps, 700.0))) / args.delta
    return (f"epsilon = {eps:.4f} at delta={args.delta:g} (sigma={sigma:.4f}, q={args.sampling_rate:g}, {args.steps} "
            f"steps, {args.accountant.upper()}); Poisson batch cap {sampler.capacity} slots for N={args.dataset_size} "
            f"(expected batch {args.sampling_rate * args.dataset_size:.1f}): truncation charged {charge:.2g} of delta")


def _load_config_file(path: str) -> dict:
    import json
    from pathlib import Path

    from dpzero_jax.validation import import_optional, read_text

    file = Path(path)
    text = read_text(file, "--config")
    yaml = import_optional("yaml", "train", "a YAML --config file") if file.suffix in (".yaml", ".yml") else None
    try:
        data = json.loads(text) if yaml is None else yaml.safe_load(text)
    except Exception as error:  # noqa: BLE001 -- any parse error becomes a one-line message
        raise ValueError(f"--config: cannot parse {path!r}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of options")
    return data


def _train(args) -> str:
    from dpzero_jax.train import TrainConfig, Trainer

    values, resume = _train_values(vars(args).copy())
    result = Trainer(TrainConfig.from_dict(values)).run(resume=resume)
    exported = f"\nHugging Face checkpoint in {values['export']}" if values.get("export") else ""
    return result.summary() + f"\noutputs in {result.out}" + exported


def _audit(args) -> str:
    from dpzero_jax.audit import AuditConfig, audit
    from dpzero_jax.train import TrainConfig

    options = vars(args).copy()
    audit_config = AuditConfig(canaries=options.pop("canaries"), input_canaries=options.pop("input_canaries"),
                               confidence=options.pop("confidence"), canary_norm=options.pop("canary_norm", None),
                               seed=options.pop("audit_seed"))
    as_json = options.pop("audit_json", False)
    values, _ = _train_values(options)
    report = audit(TrainConfig.from_dict(values), audit_config)
    return report.to_json() if as_json else report.table()


def _train_values(options: dict) -> tuple[dict, bool | str]:
    """``(TrainConfig values, resume)`` from the parsed train flags (``--config`` file first, flags over it)."""
    options.pop("command")
    resume = "or-start" if options.pop("resume_or_start", False) else options.pop("resume", False)
    options.pop("resume", None)
    config_file = options.pop("config", None)
    values = _load_config_file(config_file) if config_file is not None else {}
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    # the file on its own must be consistent (noise_multiplier / epsilon / no_dp exclusive, real booleans) ...
    from dpzero_jax.validation import check_privacy_options

    check_privacy_options(values, f"--config {config_file}" if config_file is not None else "TrainConfig")
    # ... and a privacy flag on the command line replaces the file's privacy choice
    for flag in ("epsilon", "noise_multiplier", "no_dp"):
        if flag in options:
            for name in ("epsilon", "noise_multiplier", "no_dp"):
                values.pop(name, None)
    if "steps" in options:
        values.pop("epochs", None)
    if "epochs" in options:
        values["steps"] = None
    values.update(options)
    _infer_task(values)
    return values, resume


def _infer_task(values: dict) -> None:
    """``--model hf:DIR`` without ``--task``: causal-lm for a GPT-2 checkpoint (the only causal LM supported)."""
    model = values.get("model")
    if "task" in values or not isinstance(model, str) or not model.startswith("hf:"):
        return
    from dpzero_jax import hf

    try:
        model_type = hf.read_config(model[3:].strip()).get("model_type")
    except Exception:  # noqa: BLE001 -- the Trainer reports an unreadable checkpoint with its own message
        return
    if model_type == "gpt2":
        values["task"] = "causal-lm"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(train_flags=not argv or argv[0] not in ("privacy", "plan")).parse_args(argv)
    try:
        if args.command == "privacy":
            print(_privacy(args))
        elif args.command == "train":
            print(_train(args))
        elif args.command == "audit":
            print(_audit(args))
        elif args.command == "plan":
            print(planner.run(args))
    except (ValueError, FileExistsError, FileNotFoundError, ImportError, RuntimeError) as error:
        print(f"dpzero {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
