"""What every `python -m …` entry point shares: the parser with `--config`, dotted overrides,
`--print-config` and `--debug`; one logging format; and `cli_main`, which turns a `UserError` (or a
usage mistake) into one `error: …` line and a non-zero exit instead of a traceback."""

from __future__ import annotations

import _thread
import argparse
import atexit
import copy
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import traceback
from typing import Any, Callable, Sequence

import yaml

from gemma_tpu.core.config import RunConfig, as_written, is_url, load_config
from gemma_tpu.core.errors import SignalExit, UserError, raise_signal_exit
from gemma_tpu.core.lean_imports import deferred_imports
from gemma_tpu.core.xla_cache import heal_damaged_entries

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log at INFO on every call; entry points keep them at WARNING.
NOISY_LOGGERS = ("absl", "jax", "orbax", "tunix", "qwix", "httpx", "urllib3", "huggingface_hub")
DEBUG_ENV = "GEMMA_TPU_DEBUG"
_debug = os.environ.get(DEBUG_ENV) == "1"  # set by cli_main from --debug / GEMMA_TPU_DEBUG=1


def parser(prog: str, doc: str | None, config: str | None = None, overrides: bool = True,
           print_config: bool = True, override_example: str = "train.max_steps=20",
           config_root: type = RunConfig, config_keys: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """An entry point's parser. `doc`: the module docstring, shown whole by `--help` (its first line alone
    was a usage line, cut mid-option where it wrapped, and said nothing of what the command does).
    `config`: the help text of `--config` (None: no --config). `--debug` (shows tracebacks; also
    GEMMA_TPU_DEBUG=1) is taken off the command line by `cli_main` and listed here only for `--help`.
    `config_root`: the config class the overrides set (an unknown `--max-steps` is told its override);
    `config_keys`: the keys (or sections) of it the command reads, where not all (`_config_key`'s `within`)."""
    cls = _OverridesParser if overrides else _Parser
    p = cls(prog=prog, description=doc.strip() if doc else None, formatter_class=_HelpFormatter)
    if overrides:
        p.config_root, p.config_keys = config_root, config_keys
    if config is not None:
        p.add_argument("--config", action=_Once, help=config)
        if print_config:
            p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    if overrides:
        p.add_argument("overrides", nargs="*", help=f"dotted config overrides, e.g. {override_example} (also "
                                                    f"--set {override_example}); a key given twice takes the last "
                                                    f"value, with a warning")
    return p


def subcommand(subparsers, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser, formatted as `parser`'s: argparse's own showed its options with no defaults
    (`generate --train TRAIN` left a user to guess the 1200 the README's committed splits hold)."""
    return subparsers.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each option's default where it has one its help does not state
    (`--num-prompts NUM_PROMPTS` alone left a user to guess how many requests a run sends)."""

    def _format_action(self, action):
        if not action.help and _shows_default(action):  # argparse prints no help line for an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if _shows_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _shows_default(action: argparse.Action) -> bool:
    d = action.default
    return bool(action.option_strings) and d is not None and d is not False and d != argparse.SUPPRESS and d != []


class _Once(argparse.Action):
    """An option given at most once: a second `--config` replaced the first without a word (configs do not
    merge; the first one's settings were all ignored)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not str(values).strip():  # `--config "$CFG"` with CFG unset: evaluate (and --print-config) ran on defaults
            parser.error(f"{option_string} is empty (an unset variable?); give a YAML config file")
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}); configs do not "
                         f"merge: give one, and change keys with overrides (section.key=value)")
        try:  # `--config=~/run.yaml`: the shell expands no `~` after '=' ("config file not found: ~/run.yaml")
            values = _home(values)
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument {option_string}: {e}")
        setattr(namespace, self.dest, values)


# a value argparse takes for an option (`--max-shard-size -1GB`, `--max-kl -1e-3`, `--x -inf`): its own test of a
# negative number is `-1` or `-0.5` alone
_NEGATIVE = re.compile(r"-(\d|\.\d|inf\b|nan\b)", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """argparse read an option's value beginning with '-' that is not a plain negative number (`-1GB`, `-1e-3`) as an
    option, and said 'argument --max-shard-size: expected one argument', never what is wrong with the value: such a
    value is given to its option (as `--opt=VALUE`), whose own check then says it (`size '-1GB' must be positive`)."""

    def parse_known_args(self, args=None, namespace=None):
        args = _negative_values_attached(self, sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)


ArgumentParser = _Parser  # a plain parser (the benchmarks' own) that takes `--opt -1e-3` as `parser`'s do


def _negative_values_attached(p: argparse.ArgumentParser, args: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":  # everything after it is positional already
            out += args[i:]
            break
        nxt = args[i + 1] if i + 1 < len(args) else None
        if (nxt is not None and a.startswith("--") and "=" not in a and _NEGATIVE.match(nxt)
                and nxt not in p._option_string_actions and _takes_one_value(p, a)):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _takes_one_value(p: argparse.ArgumentParser, option: str) -> bool:
    """Whether `option` (or the one long option it abbreviates) takes exactly one value."""
    action = p._option_string_actions.get(option)
    if action is None and p.allow_abbrev:
        actions = {a for o, a in p._option_string_actions.items() if o.startswith(option)}
        action = actions.pop() if len(actions) == 1 else None
    return action is not None and action.nargs is None


class _OverridesParser(_Parser):
    """A parser whose dotted overrides may come before, between or after the options
    (`--dry-run train.max_steps=5 --devices 8 mesh.fsdp=8`): plain argparse takes the overrides of the
    first run only and refuses the rest as unrecognized arguments."""

    config_root: type = RunConfig
    config_keys: Sequence[str] | None = None

    def parse_args(self, args=None, namespace=None):
        args = _bare_overrides(sys.argv[1:] if args is None else args)
        self._refuse_config_options(args)
        return self.parse_intermixed_args(args, namespace)

    def _refuse_config_options(self, args: Sequence[str]) -> None:
        """A config key given as an option, as HfArgumentParser (a TRL recipe's command line: `--learning_rate 1e-4`)
        or absl/Hydra (`--train.max_steps=3`) take them, is named with the override that sets it; it was
        'unrecognized arguments'. An option of this command (or an abbreviation argparse takes) is left alone."""
        for i, arg in enumerate(args):
            if arg == "--":
                return
            name, eq, value = arg.partition("=")
            if not name.startswith("--") or len(name) < 3 or any(o.startswith(name) for o in
                                                                 self._option_string_actions):
                continue
            meant = _config_key(self.config_root, name[2:], self.config_keys)
            if meant is None:
                continue
            key, note = meant
            given = arg
            if not eq:  # `--key VALUE`, or a switch (`--shuffle`): true
                nxt = args[i + 1] if i + 1 < len(args) else None
                value = nxt if nxt is not None and not nxt.startswith("-") and "=" not in nxt else "true"
                given = arg if value == "true" and nxt != "true" else f"{arg} {value}"
            raise UserError(f"{given}: config keys are set by overrides, not options: write {key}={value}{note}")


def _config_key(cls: type, name: str, within: Sequence[str] | None = None) -> tuple[str, str] | None:
    """The dotted key of `cls` an option's name (`max-steps`, `train.max_steps`, a transformers/TRL name) sets, and a
    note on it; None where it names none, or several. `within`: the keys (or sections) the command reads, the only
    ones named (evaluate reads data.* and model.dtype: `--max-steps` names no key of its)."""
    from gemma_tpu.core.recipe_names import FOREIGN_NAMES, OLDER_NAMES
    from gemma_tpu.core.typed_yaml import leaf_keys

    name = name.replace("-", "_")
    keys = [k for k in leaf_keys(cls) if "." in k and k not in OLDER_NAMES
            and (within is None or any(k == w or k.startswith(f"{w}.") for w in within))]
    if name in keys:
        return name, ""
    leaf = name.rpartition(".")[2]
    same = [k for k in keys if k.rpartition(".")[2] == leaf]
    if len(same) == 1:
        return same[0], ""
    foreign = FOREIGN_NAMES.get(leaf) if cls is RunConfig else None
    if foreign and foreign[0] in keys:
        note = f"; {foreign[1]}" if foreign[1] else ""
        return foreign[0], f" (the {foreign[2] if len(foreign) > 2 else 'transformers/TRL'} name{note})"
    return None


def _bare_overrides(args: Sequence[str]) -> list[str]:
    """`--set KEY=VALUE` (or `--set=KEY=VALUE`, as Helm and many launchers spell an override) as the bare override,
    in its place: it was 'unrecognized arguments: --set train.max_steps=3'. An empty value stays the override's own
    error (`--set train.max_steps=` is "train.max_steps: expected an integer, got ''")."""
    out: list[str] = []
    args = list(args)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":  # everything after it is positional already
            out += args[i:]
            break
        if a == "--set" or a.startswith("--set="):
            value = a[len("--set="):] if a.startswith("--set=") else (args[i + 1] if i + 1 < len(args) else None)
            if value is None or value.startswith("-"):
                raise UserError("--set needs an override after it, e.g. --set train.max_steps=20")
            out.append(value)
            i += 1 if a.startswith("--set=") else 2
            continue
        out.append(a)
        i += 1
    return out


def number(low: float, low_ok: bool = False, high: float | None = None) -> Callable[[str], float]:
    """An argparse `type`: a finite float above `low` (or equal to it with `low_ok`), at most `high`.
    `float` took `nan` and `inf`: `--timeout nan` ended in a socket traceback, `--temperature nan` in
    one from the JSON encoder."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (value == low and not low_ok) or (
                high is not None and value > high):
            bound = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number {bound}")
        return value

    parse.__name__ = "number"
    return parse


def integer(low: int = 1) -> Callable[[str], int]:
    """An argparse `type`: an integer of at least `low` (a count: steps, rows, prompts). `int` took 0 and negatives,
    which the benchmarks met minutes later as a ZeroDivisionError or a child's traceback."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}")
        return value

    parse.__name__ = "integer"
    return parse


def integers(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse `type`: comma-separated integers of at least `low` (`--seq-lens 256,512`)."""
    one = integer(low)

    def parse(text: str) -> list[int]:
        values = [one(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers")
        return values

    parse.__name__ = "integers"
    return parse


def output_path(text: str, what: str = "a file or directory") -> str:
    """An argparse `type` for a path written to: `--out ""` is the working directory to pathlib, and was
    refused as '. already exists' (or, with --overwrite, checked as the working directory). A leading `~` is the
    home directory, as in the config's paths: the shell expands none after `--out=`, and `--out=~/merged` wrote a
    directory named `~` in the working directory. `output_path_of` names what the option writes."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty path names no {what} to write")
    if is_url(text):  # `--out gs://b/merged` wrote a local directory named `gs:`
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; the {what} is written on this machine: give a local "
                                         f"path, or mount the bucket (gcsfuse BUCKET /mnt/BUCKET) and give the path "
                                         f"under it")
    return _home(text)


def work_dir(text: str) -> str:
    """An argparse `type` for a directory a command makes (or reuses) to work in (a benchmark's `--workdir`): a path
    that is a file, or lies under one, is refused here, naming the option; it was 'error: File exists: X' (or a
    FileExistsError traceback) once the command had started, the option not named."""
    text = output_path(text, "work directory")
    probe = os.path.abspath(text)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.lexists(probe) and not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory" if probe == os.path.abspath(text) else
                                         f"{text!r}: {probe} is a file, so no directory can be made under it")
    return text


def _home(text: str) -> str:
    """`text` with a leading `~` (or `~user`) expanded; an unknown user is refused."""
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):  # expanduser leaves a user it cannot find as it was
        user = text[1:].split("/", 1)[0]
        raise argparse.ArgumentTypeError(f"{text!r}: '~{user}' is the home directory of user {user!r}, whom this "
                                         f"machine does not know; write the path out")
    return expanded


def output_path_of(what: str):
    """`output_path` for an option that writes `what` ("output .gguf file"): its error says so, after the option
    argparse names (`argument --out: an empty path names no output .gguf file to write`)."""

    def output_path_(text: str) -> str:
        return output_path(text, what)

    output_path_.__name__ = "output_path"
    return output_path_


def input_path_of(what: str):
    """An argparse `type` for an option naming `what` to read ("model directory"): an empty one (`--model "$M"` with
    M unset) is refused, where it was taken for no option at all (evaluate then asked an endpoint of None: a
    traceback) or for the working directory; a leading `~` is the home directory, as for outputs."""

    def input_path_(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty path names no {what}")
        # a bucket's `gs://b/run` was read as the local path `gs:/b/run` ("does not exist"); http(s) addresses are
        # left to the readers, which say what to give instead (a hub id for a model page, a download for data)
        if is_url(text) and not text.lower().startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"{text!r} is a URL; the {what} is read from this machine's disk: copy "
                                             f"it here, or mount the bucket (gcsfuse BUCKET /mnt/BUCKET) and give the "
                                             f"path under it")
        return _home(text)

    input_path_.__name__ = "input_path"
    return input_path_


# seconds a request may wait: positive, and within what a socket timeout takes (1e10 s overflows time_t)
SECONDS = number(0.0, high=1e6)


def print_config(cfg: Any) -> None:
    """The resolved config as YAML (the form `--config` reads back)."""
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")


def run_config(args: argparse.Namespace, required: bool = True):
    """The `RunConfig` of `--config` plus overrides (defaults when neither is given and not `required`);
    None once `--print-config` has printed it, so the caller returns."""
    if required and not args.config:
        given = next((o for o in args.overrides or () if "=" not in o and o.lower().endswith((".yaml", ".yml"))), None)
        raise UserError(f"--config FILE is required: give it as --config {given}" if given else
                        "--config FILE is required (see configs/)")
    cfg = load_config(args.config, args.overrides) if (args.config or args.overrides) else RunConfig()
    if getattr(args, "print_config", False):
        print_config(as_written(cfg))  # the form --config reads back: a path's `$` as `$$`
        return None
    return cfg


def setup_logging(level: int = logging.INFO) -> None:
    """One format for every entry point: time, level, logger, message, on stderr. A bare default handler
    that a library put on the root logger first (absl calls `basicConfig()` on its first message) is
    replaced, or it would swallow this format and level."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in root.handlers:
        if not any(isinstance(f, _LibraryTracebacks) for f in handler.filters):
            handler.addFilter(_LibraryTracebacks())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class _LibraryTracebacks(logging.Filter):
    """Orbax logs, traceback and all, every exception its background threads meet (a save that hits a full
    disk, a quota or a read-only directory: four ~40-line tracebacks, one per writer thread) before the save
    raises it where we say it in one line (`finite_guard.save_failure`). Such a record is logged at DEBUG;
    with --debug / GEMMA_TPU_DEBUG=1 it is shown as Orbax logged it, with our own traceback after it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _debug or not record.exc_info or record.levelno < logging.ERROR or not _raised_in_orbax(record.exc_info):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def _raised_in_orbax(exc_info) -> bool:
    """Whether the exception went through Orbax's code (absl names its own module as the record's source
    when Orbax logs from a thread, so the traceback is what tells)."""
    tb = exc_info[2] if isinstance(exc_info, tuple) else None
    return any(f"{os.sep}orbax{os.sep}" in frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb))


def _redeliver_interrupts(unraisable) -> None:
    """`sys.unraisablehook`: a Ctrl-C (KeyboardInterrupt) or a SIGTERM turned into `SignalExit` that
    surfaced where Python cannot propagate an exception (a gc callback, which jax registers: about one
    Ctrl-C in three during a merge was printed as "Exception ignored" and the merge went on to publish)
    is signalled again, from another thread so that it is not handled inside this hook, where it would be
    lost the same way; the main thread raises it at the next point that can. Anything else is reported."""
    exc = unraisable.exc_value
    signum = (signal.SIGINT if isinstance(exc, KeyboardInterrupt)
              else exc.signum if isinstance(exc, SignalExit) else None)
    if signum is None and not _debug and (_late_callback(unraisable) or _abandoned_read(unraisable)):
        logging.getLogger(__name__).debug("a completion reached an event loop already closed",
                                          exc_info=(type(exc), exc, unraisable.exc_traceback))
        return
    if signum is None or not callable(signal.getsignal(signum)):
        sys.__unraisablehook__(unraisable)
        return
    try:
        _thread.start_new_thread(os.kill, (os.getpid(), signum))
    except RuntimeError:  # no new threads (the interpreter is shutting down): report it as Python would
        sys.__unraisablehook__(unraisable)


def _late_callback(unraisable) -> bool:
    """TensorStore completing a write after the Orbax thread that awaited it gave up (a save that failed) and
    closed its event loop: `call_soon_threadsafe` raises, unraisably, once per write still in flight (dozens
    of tracebacks, printed between and after our one-line error). Nothing is lost: the save already failed."""
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def _abandoned_read(unraisable) -> bool:
    """An Orbax restore's read of one array, failing after the restore already failed on another (a step whose
    tensors do not fit the model: every mismatched read fails) and left unawaited: collected, its exception was
    printed as "Exception ignored in: <coroutine ...>" with a traceback, after our one-line error."""
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def cli_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)` and map `UserError` (and a few OS errors) to a one-line message. `main` runs within
    `deferred_imports`: torch and pandas are imported only by what uses them (lean_imports). Logging is set up
    at WARNING in the project's format (`setup_logging`); an entry point that shows more calls it again with its
    level. The converters and serving never did: a library warning (a stale lock taken over, an output restored)
    came out as `WARNING:gemma_tpu.core.pidlock:...` or bare."""
    global _debug
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging(logging.WARNING)
    sys.unraisablehook = _redeliver_interrupts
    heal_damaged_entries()  # every command that compiles uses JAX's persistent cache, where one is set
    debug = _debug = "--debug" in args or os.environ.get(DEBUG_ENV) == "1"
    if "--debug" in args:
        args.remove("--debug")
    parser_error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argparse_error  # usage mistakes are one line too, not usage + exit
    try:
        if argv is None:  # the process's own command line
            _stops_raise()
            atexit.register(_ignore_stops)  # the first exit handler registered is the last to run
        with deferred_imports():
            code = int(main(args) or 0)
        if argv is None:  # the process's own command line: what is left is the interpreter's shutdown
            _end_on_stop(code)
        return code
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # `interrupted_after` says what was done before it
        print(f"error: interrupted{f' after {e}' if str(e) else ''}", file=sys.stderr)
        if argv is None:  # the process's own command line: it ends here
            _exit_now(130)
        return 130
    except SignalExit as e:
        print(f"error: stopped by {signal.Signals(e.signum).name}{f' after {e.after}' if e.after else ''}",
              file=sys.stderr)
        if argv is None:
            _exit_now(int(e.code))
        return int(e.code)
    except OSError as e:  # a missing file, no permission, a full disk (ENOSPC), a file too large...
        if debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    finally:
        argparse.ArgumentParser.error = parser_error


def write_stdout(text: str, end: str = "\n") -> None:
    """Print `text` to stdout, flushed. A reader that is gone (`python -m convert.inspect DIR | head -3`) ends the
    output quietly: it was 'error: Broken pipe', exit 2, as if the command had failed. stdout then points at
    /dev/null, so that the interpreter's last flush has nothing to report either."""
    try:
        print(text, end=end)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def _stops_raise() -> None:
    """For the process's own command, SIGTERM and SIGHUP raise `SignalExit` (`raise_signal_exit`) from its start to
    `_end_on_stop`, wherever no block of it handles them (`errors.stop_signals_raise` sets back what was there): a
    stop that landed after a converter's output was published and its block left, before the command returned,
    ended the process by the signal (-15), the exit handlers not run. Ignored ones (`nohup`) stay ignored."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            try:
                signal.signal(signum, raise_signal_exit)
            except ValueError:  # not the main thread
                return


def _end_on_stop(code: int) -> None:
    """Once the command is done (its output published, `wrote ...` said), a stop signal ends the process at once
    with the command's exit code. Landing during the interpreter's shutdown (JAX's teardown takes a while), a
    SIGTERM or SIGHUP killed the process by the signal (-15, -1) after a complete, verified output, which a caller
    took for a failed conversion; there is nothing left to stop. A signal ignored at the start (`nohup`) stays so."""
    def stop(signum, frame):  # noqa: ARG001
        _flush_and_exit(code)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue
        try:
            signal.signal(signum, stop)
        except ValueError:  # not the main thread: Python runs no handlers there
            return


def _ignore_stops() -> None:
    """The last exit handler: Ctrl-C, SIGTERM and SIGHUP are ignored for the rest of the process's end. The
    interpreter then sets the signals Python handles back to their default action, and a stop that landed in what
    follows (JAX's runtime torn down, about half a second after a converter's `wrote OUT`) killed the process by
    the signal (-15, -1) after a complete output; it ends by itself with the command's exit code now."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(signum, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread (an exit from another one): as before
            return


def _exit_now(code: int) -> None:
    """End the process after a Ctrl-C or SIGTERM without JAX's teardown: every exit handler runs (locks released,
    temp files removed, logs flushed) except JAX's own (`jax._src.api.clean_up`), then the process ends without the
    interpreter's shutdown. A stop that lands while the main thread waits for a compilation (jax compiles in a thread
    pool) leaves that compilation running, and tearing down XLA's client under it (JAX's handler, or the
    interpreter freeing the client's last reference) was a segmentation fault: exit 139 instead of 130/143, about
    one stop in three at the start of an evaluation. The process is ending; its device memory goes with it."""
    api = sys.modules.get("jax._src.api")
    if api is None:  # no JAX here: the ordinary exit
        return
    clean_up = getattr(api, "clean_up", None)
    if callable(clean_up):
        atexit.unregister(clean_up)
    try:
        atexit._run_exitfuncs()
    finally:
        _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    """Flush what was said, then end the process at once with `code` (no interpreter shutdown)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say
            pass
    os._exit(code)


def _argparse_error(parser, message: str):
    """argparse's `error`, as a UserError: `error: python -m X: argument --y: ... (see --help)`."""
    raise UserError(f"{parser.prog}: {message} (see --help)")
