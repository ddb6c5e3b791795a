"""Root command: global options, and one sub-command per area.

Areas are found through :data:`AREAS`, a lazy table of ``name -> (module holding a Typer app, help)``:
an area's module is imported only when its command runs (or its own ``--help`` is asked for), so
``llmtool --help`` imports neither torch nor any area. Adding an area is one line here and a folder
with a ``cli.py``; no area imports another.

The dialect is written down in docs/cli-conventions.md; in short:

- global options (``--json --quiet --debug --device --dtype --seed --threads``) may stand before *or
  after* the sub-command (``llmtool evaluate ppl MODEL --json`` works);
- every failure is one ``error:`` line on stderr: exit 2 for usage errors (Typer's own parse errors
  included), 130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM is handled like Ctrl-C:
  temporary outputs are removed), 1 with a hint for internal faults (the traceback only with
  ``--debug``);
- every count option of every command is bounded by name (``core/options.py``'s ``COUNT_BOUNDS``:
  threads and worker processes by the cores this process may use, batch sizes, lengths and sample
  counts by sane limits), checked before the command body runs;
- a user error that escaped its command's own checks (an unreadable path, a symlink loop, a file that
  is not UTF-8, input nested beyond the recursion limit) is still one line with exit 2, never an
  ``internal error``.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import os
import signal
import sys
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.29 carries its own fork of click
    from typer import _click as click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer._click.exceptions import UsageError as ParseError
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - older typer on click
    import click
    from click.exceptions import Abort, ClickException, NoArgsIsHelpError
    from click.exceptions import UsageError as ParseError

from llmtool import __version__
from llmtool.core.console import OPTIONS, Terminated, UsageError, fail
from llmtool.core.options import available_cpus, check_count, check_counts

# name -> (module holding `app`, one-line help). Order = order in --help.
AREAS: dict[str, tuple[str, str]] = {
    "models": ("llmtool.core.models_cli", "Packaged default models: list and materialize them."),
    "compress": ("llmtool.compress.cli", "Low-rank compression: zs-svd and its SVD baselines."),
    "quantize": ("llmtool.quantize.cli", "Weight/activation quantization: respinquant, quarot, rtn."),
    "kvcache": ("llmtool.kvcache.cli", "KV-cache eviction and quantization during generation."),
    "edit": ("llmtool.edit.cli", "Knowledge editing (memit, alphaedit) and keystone neurons."),
    "evaluate": ("llmtool.evaluate.cli", "Perplexity, best-model identification, judges, autograders."),
    "evade": ("llmtool.evade.cli", "Watermarking, detection and watermark-evasion attacks."),
    "select-data": ("llmtool.select_data.cli", "Data selection: GEM domain discovery and mixing, SHIFT."),
    "route": ("llmtool.route.cli", "Token-level collaboration of expert models: FusionRoute and baselines."),
    "train": ("llmtool.train.cli", "Training: GRPO (RLVR), pretraining and SFT with AdaGC clipping."),
    "bench-agent": ("llmtool.bench_agent.cli", "Agent benchmarks: PIPE interface rewrites, UltraHorizon."),
    "tasks": ("llmtool.learn_program.tasks_cli", "Algorithmic program-learning tasks: list and generate."),
    "learn-program": ("llmtool.learn_program.cli", "LLM-PV propose-and-verify program learning and baselines."),
    "example-data": ("llmtool.core.examples", "Small input files for the README's examples (prompts, corpus, pairs, ...)."),
    "doctor": ("llmtool.core.doctor", "What is installed: versions, packaged models, extras, sandbox, threads, device."),
}

# Global options that may follow the sub-command: flag -> takes a value?
GLOBAL_FLAGS = {"--json": False, "--quiet": False, "-q": False, "--debug": False,
                "--device": True, "--dtype": True, "--seed": True, "--threads": True}


def hoist_globals(args: list[str], commands) -> list[str]:
    """Move global options found after the sub-command name to before it (``--`` ends the scan)."""
    args = list(args)
    pos = next((i for i, a in enumerate(args) if a in commands), None)
    if pos is None:
        return args
    head, tail, moved = args[:pos + 1], [], []
    rest = args[pos + 1:]
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--":
            tail.extend(rest[i:])
            break
        name = a.split("=", 1)[0]
        if name in GLOBAL_FLAGS:
            if GLOBAL_FLAGS[name] and "=" not in a and i + 1 < len(rest):
                moved.extend(rest[i:i + 2])
                i += 2
                continue
            moved.append(a)
        else:
            tail.append(a)
        i += 1
    return head[:pos] + moved + head[pos:] + tail


def bounded(cmd: Any) -> Any:
    """``cmd`` with its callback checking the count bounds of its options (``core.options.COUNT_BOUNDS``)
    before it runs; a group's sub-commands get the same wrapper when they are looked up (areas build
    some of them lazily)."""
    if cmd is None or getattr(cmd, "_llmtool_bounded", False):
        return cmd
    cmd._llmtool_bounded = True
    if cmd.callback is not None:
        flags = {p.name: next((o for o in p.opts if o.startswith("--")), p.opts[0] if p.opts else p.name)
                 for p in cmd.params if p.name}
        inner = cmd.callback

        @functools.wraps(inner)
        def checked(*args: Any, **kwargs: Any) -> Any:
            check_counts(kwargs, flags)
            return inner(*args, **kwargs)

        cmd.callback = checked
    if hasattr(cmd, "get_command"):
        lookup = cmd.get_command

        def get_command(ctx: Any, name: str) -> Any:
            return bounded(lookup(ctx, name))

        cmd.get_command = get_command
    return cmd


_USER_ERRNOS = {errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO,
                errno.ENAMETOOLONG, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ETXTBSY, errno.ENODEV}


def user_error_message(e: BaseException) -> str | None:
    """The one-line message for an exception that is the user's input, not a fault of llmtool, when a
    command's own checks let it through: a path that cannot be read or written (named), a file that is not
    UTF-8, input nested beyond the recursion limit. None for anything else (an internal error)."""
    if isinstance(e, RecursionError):
        return "an input is nested too deeply (structured data beyond Python's recursion limit)"
    if isinstance(e, UnicodeDecodeError):
        where = _file_in_traceback(e)
        return f"{where or 'an input file'}: not UTF-8 text ({e.reason} at byte {e.start})"
    if isinstance(e, OSError) and e.errno in _USER_ERRNOS and e.filename is not None:
        return f"{e.filename}: {e.strerror or type(e).__name__}"
    return None


def _file_in_traceback(e: BaseException) -> str | None:
    """The file an exception was reading, when the innermost llmtool frame holds it in a local called like a
    path (``path``, ``p``, ``f``, ``file``, ``source``): decode errors carry no file name of their own."""
    import pathlib

    tb, found = e.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__", "").startswith("llmtool."):
            for name in ("path", "p", "f", "file", "fname", "source", "src"):
                v = frame.f_locals.get(name)
                if isinstance(v, (str, pathlib.PurePath)) and v and pathlib.Path(v).is_file():
                    found = str(v)
                    break
        tb = tb.tb_next
    return found


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _default_sigterm_in_child() -> None:
    """A forked worker (a process pool) gets SIGTERM's default back: its parent's pool stops it with SIGTERM,
    which must kill it, not unwind it as a command."""
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


class AreaGroup(TyperGroup):
    """The root group: areas loaded lazily, globals hoisted, every error one line."""

    _listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(AREAS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name not in AREAS:
            return None
        module, help_text = AREAS[name]
        if self._listing:  # root --help: a name and a line, no import
            return TyperCommand(name, help=help_text, short_help=help_text, callback=None)
        sub = bounded(typer.main.get_command(importlib.import_module(module).app))
        sub.name = name
        if not sub.help:
            sub.help = help_text
        sub.short_help = help_text
        return sub

    def format_help(self, ctx: click.Context, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_globals(args, AREAS))

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        import csv

        with contextlib.suppress(OverflowError):  # a long CSV field is data, not an error
            csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        previous = None
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            rv = super().main(args=args, prog_name=prog_name or "llmtool", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            rv = 0
        except ParseError as e:
            where = f"`{e.ctx.command_path}`: " if e.ctx is not None and e.ctx.command_path != "llmtool" else ""
            fail(f"{where}{e.format_message()} (see --help)", 2)
        except ClickException as e:
            fail(e.format_message(), e.exit_code)
        except UsageError as e:
            fail(str(e), e.exit_code)
        except Terminated:
            fail("terminated", Terminated.exit_code)
        except (Abort, KeyboardInterrupt):
            fail("interrupted", 130)
        except SystemExit:
            raise
        except Exception as e:  # an internal fault: one line and a hint, the traceback only on request
            if OPTIONS.debug:
                raise
            user = user_error_message(e)
            if user is not None:
                fail(user, 2)
            msg = str(e).splitlines()[0] if str(e) else ""
            fail(f"internal error: {type(e).__name__}: {msg} (rerun with --debug for the traceback)", 1)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if rv == 130:  # typer turns Ctrl-C into Exit(130) before it reaches the handlers above
            fail("interrupted", 130)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


app = typer.Typer(
    name="llmtool", cls=AreaGroup,
    help="Recent LLM research methods and their baselines, on local Hugging Face checkpoints.",
    rich_markup_mode="rich", no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmtool {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")] = False,
    device: Annotated[str, typer.Option(help="Torch device: cpu, cuda, cuda:1 ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16, float16, float64.")] = "float32",
    seed: Annotated[int, typer.Option(help="Random seed for data sampling and methods.", min=0,
                                      max=2**63 - 1)] = 0,
    threads: Annotated[Optional[int], typer.Option(
        help="CPU threads for torch (default: torch's choice, or $LLMTOOL_THREADS); at most the cores "
             "available to this process.", min=1)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or status lines.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of internal errors.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Show the version and exit.")] = None,
) -> None:
    if dtype not in ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16", "float64", "fp64"):
        raise UsageError(f"unknown --dtype {dtype!r}; choose one of: float32, float16, bfloat16, float64")
    OPTIONS.json, OPTIONS.device, OPTIONS.dtype, OPTIONS.seed, OPTIONS.quiet = json_out, device, dtype, seed, quiet
    if threads is not None and threads > available_cpus():
        raise UsageError(f"--threads {threads}: at most {available_cpus()} (the CPU cores available to this process)")
    env_threads = os.environ.get("LLMTOOL_THREADS", "").strip()
    if threads is None and env_threads:  # checked here for every command; applied where torch is (job.py)
        if not env_threads.isdigit() or int(env_threads) < 1:
            raise UsageError(f"$LLMTOOL_THREADS={env_threads!r}: expected a positive integer")
        check_count("$LLMTOOL_THREADS", "threads", int(env_threads))
    OPTIONS.threads, OPTIONS.debug = threads, debug
    if threads is not None:
        from llmtool.core.job import apply_threads

        apply_threads(threads)


def main() -> None:
    """Console-script entry point (errors are handled by :class:`AreaGroup`)."""
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
