"""The ``hugeembed`` command line: one module per command, each with add_parser() and run().

Errors a user can fix (bad flags, missing files, unreadable data, invalid configs)
print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "COMMANDS"]

# command name -> module under hugeembed.cli
COMMANDS: dict[str, str] = {
    "train": "train",
    "eval": "eval",
    "convert": "convert",
    "schema": "schema",
    "inspect": "inspect",
    "bench": "bench",
    "export": "export",
    "serve": "serve",
}


class _Parser(argparse.ArgumentParser):
    """Every parser of the command line: no abbreviated flags (``--npro 2`` is not ``--nproc 2``: a
    prefix would be taken for a flag, and train --nproc passes the flags on to its processes)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message)
        self.exit(2, f"hugeembed: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hugeembed", description="Train recommendation models with huge sparse embedding tables.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"hugeembed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in COMMANDS.items():
        importlib.import_module(f".{module}", __name__).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import HugeEmbedError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train --nproc` relaunches with these
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f".{COMMANDS[args.command]}", __name__)
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (HugeEmbedError, OSError, ValueError, ImportError) as e:
        print(f"hugeembed {args.command}: error: {e}", file=sys.stderr)
        _exit_now_if_distributed(2)
        return 2
    except KeyboardInterrupt:
        print(f"hugeembed {args.command}: interrupted", file=sys.stderr)
        return 130


def _exit_now_if_distributed(code: int) -> None:
    """A failed process of a distributed run exits at once: tearing its process group down would wait
    for (or abort on) peers that are dead, and for an exchange thread still inside a collective."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
