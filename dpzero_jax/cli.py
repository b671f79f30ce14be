"""The ``dpzero`` command line.

``dpzero privacy --noise-multiplier S --sampling-rate Q --steps N --delta D`` prints epsilon;
``dpzero privacy --epsilon E --sampling-rate Q --steps N --delta D`` prints the noise multiplier that reaches it.
Bad values get a one-line error that names the flag.
"""

from __future__ import annotations

import argparse
import math
import sys


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


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def _privacy(args) -> str:
    from dpzero_jax import accounting

    if args.epsilon is not None:
        sigma = accounting.calibrate_noise(args.epsilon, args.sampling_rate, args.steps, args.delta,
                                           accountant=args.accountant)
        return (f"noise multiplier {sigma:.4f} gives epsilon <= {args.epsilon:g} at delta={args.delta:g} "
                f"(q={args.sampling_rate:g}, {args.steps} steps, {args.accountant.upper()})")
    eps = accounting.epsilon(args.noise_multiplier, args.sampling_rate, args.steps, args.delta,
                             accountant=args.accountant)
    return (f"epsilon = {eps:.4f} at delta={args.delta:g} (sigma={args.noise_multiplier:g}, q={args.sampling_rate:g}, "
            f"{args.steps} steps, {args.accountant.upper()})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "privacy":
            print(_privacy(args))
    except ValueError as error:
        print(f"dpzero {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
