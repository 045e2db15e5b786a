"""`tracetop rules check FILE` (exit 0, or 2 naming file, line and key) and `tracetop rules
defaults` (the built-in set, as a file to start from)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="{check,defaults,signals}")
    check = sub.add_parser("check", help="validate a rules file: exit 0, or 2 with file, line, key and the fix")
    check.add_argument("file")
    sub.add_parser("defaults", help="print the built-in rules as a TOML file to start from")
    sub.add_parser("signals", help="list the signals and their keys (units in the names)")


def run(args: argparse.Namespace) -> int:
    from collector.live import rules as R

    if args.what == "defaults":
        sys.stdout.write(R.DEFAULTS_TOML)
        return 0
    if args.what == "signals":
        for s in R.SIGNALS.values():
            print(f"{s.name}  (scope: {' | '.join(s.scopes)}{'; on a timer, hold with for_s' if s.time_based else ''})"
                  f"{'  ' + s.doc if s.doc else ''}")
            for k in s.keys:
                print(f"    {k.name:<24} {k.op:<6} {k.doc}")
        return 0
    try:
        rules, cost = R.load_all(args.file)
    except R.RulesError as e:
        print(f"tracetop rules check: {args.file} is refused:\n{e}", file=sys.stderr)
        return 2
    on = [r for r in rules if r.enabled]
    print(f"{args.file}: {len(rules)} rules, {len(on)} enabled: " + ", ".join(r.name for r in on))
    price = f"{cost.price_per_gpu_hour:g} {cost.currency} per GPU-hour" if cost.priced else "no price"
    print(f"[cost]: {price}, communication baseline {cost.comm_baseline_share:.0%} of the step, "
          f"recent window {cost.window_s:g} s")
    return 0
