"""`memsched policies`: list the registered placement policies and their options.

One line per policy (name, help, options with defaults and allowed values); ``--verbose`` adds each option's
help below it, ``--json`` prints the same as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json

import policies


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
