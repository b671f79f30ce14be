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


def _add_train_parser(commands, with_flags: bool = True, name: str = "train",
                      help: str = "train a model with DP-SGD (default: MLP on digits, epsilon 3)",
                      resumable: bool = True):
    # every default is None (SUPPRESS): unset flags fall back to --config, then to TrainConfig's defaults
    train = commands.add_parser(name, help=help, argument_default=argparse.SUPPRESS)
    if not with_flags:
        return train
    from dpzero_jax.options import add_flags
    from dpzero_jax.train_config import GROUPS

    train.add_argument("--config", help="JSON or YAML file of TrainConfig options (flags override it)")
    resume = train.add_mutually_exclusive_group() if resumable else None   # an audit is one fresh run
    if resume is not None:
        resume.add_argument("--resume", action="store_true",
                            help="continue from the latest checkpoint in --out (an error if there is none)")
        resume.add_argument("--resume-or-start", action="store_true",
                            help="resume if --out holds a checkpoint, else start a new run there")
    exclusive = {}   # flags of fields tagged alike (--steps / --epochs; --epsilon / --noise-multiplier / --no-dp)
    for group in GROUPS:   # one flag per TrainConfig field, from its metadata (dpzero_jax.options)
        add_flags(train, group, exclusive)
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
    from dpzero_jax.train_config import BOOL_OPTIONS
    from dpzero_jax.validation import check_privacy_options

    check_privacy_options(values, f"--config {config_file}" if config_file is not None else "TrainConfig",
                          BOOL_OPTIONS)
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
