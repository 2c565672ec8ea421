"""``m3export`` command line: one sub-command per module in ``m3export.commands``.

Each command module defines ``NAME``, ``HELP``, ``EXAMPLES``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

COMMANDS = ("synth", "export", "verify", "build", "compare", "generate", "serve", "triton_repo", "demo")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples keep their layout, and every option that has a default value says it (unless its help already
    does): a new user reads what happens when the option is left out."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="m3export",
        description="Take MiniMax M3 from PyTorch to ONNX / ONNX Runtime / TensorRT / Triton.",
        epilog="Run 'm3export COMMAND --help' for examples of each command.",
    )
    parser.add_argument("--version", action="version", version=f"m3export {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod_name in COMMANDS:
        mod = importlib.import_module(f"m3export.commands.{mod_name}")
        p = sub.add_parser(
            mod.NAME, help=mod.HELP, description=mod.HELP, epilog="examples:\n" + mod.EXAMPLES,
            formatter_class=HelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            return int(args._run(args) or 0)
        finally:
            # A backstop, not the fix: `verify`, `generate` (Engine.close -> the backend) and the runtime close
            # their ONNX Runtime sessions explicitly (PagedSession.close), while the CUDA runtime is still up. Left
            # to the interpreter's exit, ORT's CUDA EP frees its pinned buffers after the runtime has shut down, and
            # `cudaFreeHost` failing (error 800) in a destructor aborts the process (exit 134 after a `verify` that
            # had PASSED, on the H200). Sessions other code paths open and drop without closing (a vision
            # session, the per-rank graphs' sessions) may still sit in reference cycles: this frees them in time.
            gc.collect()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's job is to turn errors into one clear line
        from .errors import M3Error

        if isinstance(e, M3Error):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
