"""Options declared once: a dataclass field's metadata drives validation and CLI flags.

Every config record (`EngineArgs`, `SamplingParams`, `KVTransferConfig`, each
connector's settings, the scenario's and `serve-demo`'s flags) declares each option as
`field_name: type = option(default, "help", kind, minimum=..., ...)` (`REQUIRED` for
an option without a default). From that line:
`validate(record)` checks every value (a `ValueError` naming the field, the value
and what is allowed), `from_dict(cls, values, what)` builds a record from a plain
dict (JSON) with a "did you mean" for an unknown key, `add_flags(parser, cls)` adds
`--field-name` to an argparse parser (`add_record_flags` the flags of several
records, refusing two options of one name), `from_namespace(cls, ns)` builds the
record from the parsed flags, and `to_argv(record)` turns a record back into flags
(to start another process).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_SPEC = "kvrecover_option"
REQUIRED: Any = dataclasses.MISSING  # `option(REQUIRED, ...)`: the option has no default


@dataclass(frozen=True)
class OptionSpec:
    """How one option is checked and how it appears on the command line.

    `kind` is int, float, bool, str or any class (an isinstance check). `minimum` /
    `maximum` are inclusive bounds, `above` an exclusive lower bound. `check` is an
    extra test run after the generic ones, returning what is allowed (in words) when
    the value fails, else None. `convert` runs first on any given value (a path-like
    to str, a list of dicts to records; it may raise a ValueError of its own) and must
    accept what it returns. `parse` turns a flag's string into a value (default:
    `kind`), `format` a value back into a flag's string. `describe` replaces the
    generated "what is allowed" text; `shown` writes the rejected value into the
    message (default: repr; a secret-bearing value shows itself redacted).
    `flag=False` keeps an option off the CLI. `nargs` (argparse's, e.g. "+") makes a
    flag take several values, the option their list (`parse` then reads each one).
    """

    help: str
    kind: type
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    check: Callable[[Any], str | None] | None = None
    convert: Callable[[Any], Any] | None = None
    shown: Callable[[Any], str] = repr
    parse: Callable[[str], Any] | None = None
    format: Callable[[Any], str] = str
    metavar: str | None = None
    flag: bool = True
    describe: str | None = None
    nargs: str | None = None

    def allowed(self, or_none: bool = True) -> str:
        """What the option accepts, in words (for error messages); `describe` overrides.
        `or_none=False` leaves out "(or None)" (a flag's value is never None)."""
        if self.describe is not None:
            text = self.describe
        elif self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = {int: "an integer", float: "a finite number", bool: "True or False",
                    str: "a string"}.get(self.kind, f"a {self.kind.__name__}")
            bounds = []
            if self.above is not None:
                bounds.append(f"> {self.above}")
            if self.minimum is not None:
                bounds.append(f">= {self.minimum}")
            if self.maximum is not None:
                bounds.append(f"<= {self.maximum}")
            if bounds:
                text += " " + " and ".join(bounds)
        return text + (" (or None)" if self.nullable and or_none else "")


def option(default: Any, help: str, kind: type, *, repr: bool = True, **spec: Any) -> Any:
    """A dataclass field carrying its `OptionSpec` (see the module docstring). A dict or
    list default is copied for each record; `REQUIRED` makes a field without one."""
    metadata = {_SPEC: OptionSpec(help=help, kind=kind, **spec)}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default),
                                 metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


def option_fields(cls: type) -> list[tuple[dataclasses.Field, OptionSpec]]:
    """The declared options of a dataclass, in declaration order."""
    return [(f, f.metadata[_SPEC]) for f in dataclasses.fields(cls) if _SPEC in f.metadata]


def option_names(cls: type) -> list[str]:
    """The names of the declared options of a dataclass, in declaration order."""
    return [f.name for f, _ in option_fields(cls)]


def check_value(name: str, value: Any, spec: OptionSpec) -> Any:
    """`value` (after `spec.convert`) if `spec` allows it (ints are widened to float for
    float options); otherwise a ValueError naming `name`, the value and what is allowed."""
    if spec.convert is not None:
        value = spec.convert(value)
    if value is None and spec.nullable:
        return None
    problem = _problem(value, spec)
    if problem is None and spec.check is not None:
        problem = spec.check(value)
    if problem is not None:
        raise ValueError(f"{name} must be {spec.describe or problem}, got {spec.shown(value)}")
    return float(value) if spec.kind is float else value


def _problem(value: Any, spec: OptionSpec) -> str | None:
    kind = spec.kind
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    else:
        ok = isinstance(value, kind)
    if ok and spec.choices is not None:
        ok = value in spec.choices
    if ok and kind in (int, float):
        ok = ((spec.minimum is None or value >= spec.minimum)
              and (spec.maximum is None or value <= spec.maximum)
              and (spec.above is None or value > spec.above))
    return None if ok else spec.allowed()


def validate(record: Any, label: str = "{name}") -> None:
    """Check (and normalize in place, frozen records too) every declared option of a
    dataclass instance; `label` is how messages name an option (e.g.
    "kv_connector_extra_config[{name!r}]" for a key of a JSON object)."""
    for f, spec in option_fields(type(record)):
        value = check_value(label.format(name=f.name), getattr(record, f.name), spec)
        object.__setattr__(record, f.name, value)


def from_dict(cls: type, values: Any, what: str, label: str | None = None) -> Any:
    """`cls` built from a plain dict of its options (parsed JSON): an unknown key is an
    `UnknownOptionError` "unknown <what> 'key'" with a "did you mean", a missing
    required one a ValueError. `label`, when given, names the options in the
    messages of a validation run after construction (see `validate`)."""
    if not isinstance(values, dict):
        raise ValueError(f"expected a dict of {what}s, got {values!r}")
    names = option_names(cls)
    reject_unknown(values, names, what)
    required = [f.name for f, _ in option_fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"missing {what} {missing[0]!r}")
    record = cls(**values)
    if label is not None:
        validate(record, label)
    return record


class UnknownOptionError(TypeError, ValueError):
    """An option name nobody declared (a TypeError like any unexpected keyword, and a
    ValueError like every other configuration mistake)."""


def reject_unknown(names: Iterable[str], allowed: Iterable[str], what: str) -> None:
    """An `UnknownOptionError` for the first of `names` not in `allowed`, with a
    "did you mean" for a near miss."""
    allowed = sorted(allowed)
    for name in names:
        if name not in allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownOptionError(
                f"unknown {what} {name!r}{hint} (allowed: {', '.join(allowed)})"
            )


# ----- command line --------------------------------------------------------------------
def flag_name(name: str) -> str:
    """The CLI flag of an option: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + name.replace("_", "-")


def add_record_flags(
    parser: argparse.ArgumentParser,
    *classes: type,
    skip: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """The flags of several records on one parser (a command taking engine options and
    its own): each record's flags in an argument group named after it. Two records
    declaring an option of one name is a ValueError (one flag cannot feed both);
    `from_namespace` then builds each record from the same namespace."""
    seen: dict[str, str] = {}
    skip = set(skip)
    for cls in classes:
        for name in option_names(cls):
            if name in seen and name not in skip:
                raise ValueError(f"option {name!r} is declared by both {seen[name]} and "
                                 f"{cls.__name__}; one flag cannot set both")
            seen[name] = cls.__name__
    for cls in classes:
        add_flags(parser.add_argument_group(f"{cls.__name__} options"), cls, skip=skip,
                  defaults=defaults)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add a `--flag` per declared option of `cls` (all, or those in `only`, minus `skip`).

    Unset flags stay out of the namespace, so `from_namespace` can tell the
    record's defaults (or the caller's `defaults`, shown in the help) apart from
    what the user typed.
    """
    only = None if only is None else set(only)
    defaults = defaults or {}
    for f, spec in option_fields(cls):
        if not spec.flag or f.name in skip or (only is not None and f.name not in only):
            continue
        default = defaults.get(f.name, _field_default(f))
        help_text = spec.help
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs["required"] = f.name not in defaults
        if spec.kind is bool:
            # A nullable bool (None: decided elsewhere) needs both --flag and --no-flag.
            action = (argparse.BooleanOptionalAction if default or spec.nullable
                      else "store_true")
            parser.add_argument(flag_name(f.name), action=action, help=help_text, **kwargs)
            continue
        if default is not None and spec.choices is None:
            help_text += f" (default: {default})"
        if spec.nargs is not None:
            kwargs["nargs"] = spec.nargs
        parser.add_argument(
            flag_name(f.name), type=_cli_parser(f.name, spec), choices=spec.choices,
            metavar=spec.metavar, help=help_text, **kwargs,
        )


def _cli_parser(name: str, spec: OptionSpec) -> Callable[[str], Any]:
    convert = spec.parse or spec.kind

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as error:  # argparse shows only ArgumentTypeError messages
            detail = str(error) if spec.parse else f"{name} must be {spec.allowed(False)}"
            raise argparse.ArgumentTypeError(f"{detail} (got {text!r})") from error

    parse.__name__ = spec.kind.__name__
    return parse


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_namespace(cls: type, namespace: argparse.Namespace, **defaults: Any) -> Any:
    """Build `cls` from parsed flags; `defaults` apply to flags the user did not give."""
    values = dict(defaults)
    for f, _ in option_fields(cls):
        if hasattr(namespace, f.name):
            values[f.name] = getattr(namespace, f.name)
    return cls(**values)


def to_argv(record: Any, skip: Iterable[str] = ()) -> list[str]:
    """Flags that rebuild `record` (options at their default are left out)."""
    argv: list[str] = []
    for f, spec in option_fields(type(record)):
        value = getattr(record, f.name)
        if not spec.flag or f.name in skip or value == _field_default(f):
            continue
        if spec.kind is bool:
            argv.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        elif spec.nargs is not None:
            argv += [flag_name(f.name), *(spec.format(item) for item in value)]
        elif value is not None:
            argv += [flag_name(f.name), spec.format(value)]
    return argv


def redacted(_value: Any) -> str:
    """`shown` for a secret: an error message never repeats it."""
    return "<redacted>"


def path_or_none(value: Any) -> Any:
    """`os.PathLike` -> str (options that name a folder accept both)."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value
