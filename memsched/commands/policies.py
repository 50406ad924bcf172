"""`memsched policies`: list the registered placement policies and their options.

One line per policy (name, help, options with defaults and allowed values); ``--verbose`` adds each option's
help below it, ``--json`` prints the same as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json

import policies


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "policies",
        help="list the placement policies and their options",
        description="List the registered placement policies, one line each, with their options.",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="also print each option's help")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    infos = policies.describe()
    if args.json:
        print(json.dumps([
            {"name": i.name, "help": i.help, "options": [
                {"name": n, "type": o.type_name, "default": o.default, "min": o.min, "max": o.max,
                 "allowed": o.allowed(), "help": o.help}
                for n, o in i.options.items()
            ]}
            for i in infos
        ], indent=2))
        return 0
    for info in infos:
        print(f"{info.name}: {info.help} Options: {info.options_text()}")
        if args.verbose:
            for name, opt in info.options.items():
                print(f"    {name}: {opt.help} ({opt.describe()})")
    return 0
