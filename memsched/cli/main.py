"""The ``memsched`` command line: one sub-command a module under :mod:`memsched.cli`.

The parsers are in :mod:`memsched.cli.parsers`, which imports neither torch nor rich, so ``memsched
--help`` answers in a fraction of a second. Each command module exposes ``run(args)``, taking the parsed
``argparse.Namespace`` and returning an exit code; it is imported only when its command runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Sequence

from memsched.cli.parsers import PARSERS

# Sub-command modules, in the order ``memsched --help`` lists them.
COMMANDS = tuple(PARSERS)


def run_command(name: str, args: argparse.Namespace) -> int | None:
    """Import ``memsched.cli.<name>`` (torch and all) and run it."""
    return importlib.import_module(f"memsched.cli.{name}").run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsched",
        description="Memory-tracing offload scheduler for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, add_parser in PARSERS.items():
        add_parser(sub).set_defaults(func=functools.partial(run_command, name))
    return parser


def _os_error(e: OSError) -> str:
    """``'FILE': problem`` (the destination of a failed rename), or the message when no file is named."""
    name = e.filename2 if e.filename2 is not None else e.filename
    if name is None or not e.strerror:
        return str(e)
    return f"{os.fsdecode(name) if isinstance(name, (bytes, os.PathLike)) else str(name)!r}: {e.strerror}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, LookupError) as e:
        # Bad input: one clear line, no traceback (the message names the value and what is allowed).
        print(f"memsched {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written (the checks before the work missed it)
        print(f"memsched {args.command}: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"memsched {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
