"""The method contract: one registry per area (or verb), each method a config dataclass.

A method is a :class:`MethodConfig` subclass with a class-level ``name`` (its ``--method`` value) and
``help`` line, and typed fields declared with :func:`option` (default, help text, range/choices)::

    @dataclass
    class RTNConfig(MethodConfig):
        name: ClassVar[str] = "rtn"
        help: ClassVar[str] = "Round-to-nearest weights, no rotation."
        w_bits: int = option(4, "Weight bits.", choices=(3, 4, 8, 16))

    METHODS = Registry("quantize")
    METHODS.add_config(RTNConfig)

The command is derived from the registry by :func:`method_options`: it adds ``--method`` (choices from
the registry) and one option per config field (the union over methods), refuses an option that the
chosen method does not have, builds and validates the config, and passes it as ``config=``. Provenance
is ``config.as_dict()``, and :meth:`MethodConfig.from_dict` rebuilds the config from it, so a run can be
repeated from its ``llmtool.json``.

Objects that are not configs (e.g. press classes) can still be registered by name with
:meth:`Registry.register`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Optional, TypeVar

from llmtool.core.console import UsageError
from llmtool.core.options import check_count

T = TypeVar("T")


# --------------------------------------------------------------------------------------- options
def option(default: Any = dataclasses.MISSING, help: str = "", *, min: float | None = None,
           max: float | None = None, exclusive_min: bool = False, exclusive_max: bool = False,
           choices: tuple | None = None, flag: str | None = None, cli: bool = True,
           default_factory: Callable[[], Any] | None = None) -> Any:
    """A config field with its CLI help and checks (used by :meth:`MethodConfig.validate`).

    ``flag`` overrides the option name (default ``--field-name``); ``cli=False`` keeps a field out of
    the command line (library-only settings)."""
    meta = {"help": help, "min": min, "max": max, "exclusive_min": exclusive_min,
            "exclusive_max": exclusive_max, "choices": tuple(choices) if choices is not None else None,
            "flag": flag, "cli": cli}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    if isinstance(default, (list, dict, set)):
        frozen = default
        return field(default_factory=lambda: type(frozen)(frozen), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of an annotation such as ``Optional[int]`` or ``int | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _seq_item(tp: Any) -> Any | None:
    """Element type when ``tp`` is a tuple[X, ...] / list[X] annotation, else None."""
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return args[0] if args else str
    return None


def _check_number(flag: str, value: float, meta: dict) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{flag} {value}: must be a finite number")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("exclusive_min") and value == lo)):
        raise UsageError(f"{flag} {value}: must be {'>' if meta.get('exclusive_min') else '>='} {lo}")
    if hi is not None and (value > hi or (meta.get("exclusive_max") and value == hi)):
        raise UsageError(f"{flag} {value}: must be {'<' if meta.get('exclusive_max') else '<='} {hi}")


# --------------------------------------------------------------------------------------- configs
@dataclass
class MethodConfig:
    """Base of every method's config. Subclasses set ``name`` and ``help`` and declare fields with
    :func:`option`; override :meth:`validate` for cross-field checks (call ``super().validate()``)."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def type_hints(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    def validate(self) -> None:
        """Check every field against its :func:`option` metadata (finite, range, choices, type)."""
        hints = self.type_hints()
        for f in self.fields():
            value, meta, flag = getattr(self, f.name), f.metadata, flag_of(f)
            if value is None:
                continue
            base, _ = _base_type(hints.get(f.name, Any))
            items = value if _seq_item(base) is not None and isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, bool):
                    continue
                if isinstance(item, (int, float)):
                    _check_number(flag, item, meta)
                    if meta.get("max") is None:  # the shared count bounds (core/options.py) by field name
                        check_count(flag, f.name, item)
                if meta.get("choices") is not None and item not in meta["choices"]:
                    raise UsageError(f"{flag} {item!r}: choose one of {', '.join(map(str, meta['choices']))}")

    def as_dict(self) -> dict:
        """Provenance: ``{"method": name, **fields}`` (JSON-serialisable)."""
        out = {"method": self.name}
        for f in self.fields():
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "MethodConfig":
        """Rebuild a config from :meth:`as_dict` output (unknown keys refused)."""
        names = {f.name for f in cls.fields()}
        extra = sorted(set(data) - names - {"method"})
        if extra:
            raise UsageError(f"{cls.name}: unknown config fields {', '.join(extra)}")
        hints = cls.type_hints()
        kw = {}
        for k, v in data.items():
            if k == "method":
                continue
            base, _ = _base_type(hints.get(k, Any))
            kw[k] = tuple(v) if typing.get_origin(base) is tuple and isinstance(v, list) else v
        return cls(**kw)


# --------------------------------------------------------------------------------------- registry
class Registry(Generic[T]):
    """Name → method (a :class:`MethodConfig` subclass, or any object registered by name)."""

    def __init__(self, command: str, what: str = "method"):
        self.command = command
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.command}: {self.what} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def add_config(self, cls: type[MethodConfig]) -> type[MethodConfig]:
        """Register a config class under its ``name`` (usable as a class decorator)."""
        if not (isinstance(cls, type) and issubclass(cls, MethodConfig)) or not cls.name:
            raise ValueError(f"{self.command}: {cls!r} is not a MethodConfig subclass with a name")
        return self.register(cls.name)(cls)  # type: ignore[arg-type]

    config = add_config

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UsageError(
                f"unknown {self.what} {name!r} for `llmtool {self.command}`; choose one of: {', '.join(self.names())}"
            ) from None

    def get_config(self, name: str) -> type[MethodConfig]:
        obj = self.get(name)
        if not (isinstance(obj, type) and issubclass(obj, MethodConfig)):
            raise TypeError(f"{self.command}: {name!r} is not a config class")
        return obj

    def configs(self) -> list[type[MethodConfig]]:
        return [v for _, v in self.items() if isinstance(v, type) and issubclass(v, MethodConfig)]

    def build(self, name: str, **given: Any) -> MethodConfig:
        """The validated config of method ``name`` from ``given`` values; an option the method does not
        have is refused with the list of the options it has."""
        cls = self.get_config(name)
        names = {f.name: f for f in cls.fields()}
        bad = [k for k in given if k not in names]
        if bad:
            flags = ", ".join(flag_of(_union_fields(self)[k]) for k in bad)
            own = ", ".join(flag_of(f) for f in cls.fields() if f.metadata.get("cli", True)) or "none"
            raise UsageError(f"{flags} does not apply to {self.what} {name!r} "
                             f"(its options: {own})")
        cfg = cls(**given)
        cfg.validate()
        return cfg

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: Any) -> bool:
        return name in self._items

    def items(self):
        return sorted(self._items.items())


def _union_fields(reg: Registry) -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for cls in reg.configs():
        for f in cls.fields():
            out.setdefault(f.name, f)
    return out


# --------------------------------------------------------------------------------------- CLI derivation
def _cli_type(hint: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(Typer-facing type, converter to the config's type) for one field annotation."""
    base, _ = _base_type(hint)
    item = _seq_item(base)
    if item is not None:
        conv_item = {int: int, float: float}.get(item, str)

        def parse_seq(text: Any) -> tuple:
            if isinstance(text, (list, tuple)):
                return tuple(text)
            try:
                return tuple(conv_item(x.strip()) for x in str(text).split(",") if x.strip())
            except ValueError:
                raise UsageError(f"{text!r}: expected comma-separated {conv_item.__name__} values") from None

        return str, parse_seq
    if base in (int, float, str, bool):
        return base, lambda v: v
    return str, lambda v: v


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        d = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        d = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if isinstance(d, bool):
        return "on" if d else "off"
    if isinstance(d, (tuple, list)):
        return ",".join(map(str, d))
    return str(d)


def _defaults_text(registry: Registry, fname: str, owners: list[str]) -> str:
    """One default, or the most common one followed by the methods whose own default differs."""
    per = {}
    for n in owners:
        field = next(f for f in registry.get(n).fields() if f.name == fname)
        per[n] = _default_text(field)
    values = list(per.values())
    common = max(set(values), key=values.count)
    others = [f"{n}: {v}" for n, v in per.items() if v != common]
    return "; ".join([common, *others])


def method_options(registry: Registry, default: str | None = None, param: str = "config",
                   method_flag: str = "--method") -> Callable[[Callable], Callable]:
    """Decorate a Typer command taking ``config: MethodConfig``: adds ``--method`` and one option per
    config field of every method in ``registry``; the command receives the chosen, validated config.

    An option given on the command line that the chosen method lacks is an error (one line, exit 2),
    so nothing the user asked for is silently dropped."""
    import typer

    def deco(func: Callable) -> Callable:
        sig = inspect.signature(func)
        hints = typing.get_type_hints(func, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in sig.parameters.values() if p.name != param]
        taken = {p.name for p in own}
        fields = _union_fields(registry)
        field_hints: dict[str, Any] = {}
        for cls in registry.configs():
            for k, v in cls.type_hints().items():
                field_hints.setdefault(k, v)
        owners: dict[str, list[str]] = {}
        for cls in registry.configs():
            for f in cls.fields():
                owners.setdefault(f.name, []).append(cls.name)
        converters: dict[str, Callable] = {}
        new_params: list[inspect.Parameter] = []
        annotations: dict[str, Any] = {k: v for k, v in hints.items() if k != param and k != "return"}

        names = registry.names()
        method_help = "One of: " + "; ".join(
            f"{n} ({registry.get(n).help})" if getattr(registry.get(n), "help", "") else n for n in names)
        m_default = default if default is not None else ...
        method_ann = typing.Annotated[str, typer.Option(method_flag, help=method_help,
                                                        rich_help_panel="Method")]
        new_params.append(inspect.Parameter("method", inspect.Parameter.KEYWORD_ONLY, default=m_default,
                                            annotation=method_ann))
        annotations["method"] = method_ann
        for fname, f in fields.items():
            if not f.metadata.get("cli", True):
                continue
            if fname in taken or fname == "method":
                raise ValueError(f"{registry.command}: config field {fname!r} clashes with a command parameter")
            typ, conv = _cli_type(field_hints.get(fname, str))
            converters[fname] = conv
            flag = flag_of(f)
            who = owners[fname]
            applies = "" if len(who) == len(names) else f" [{', '.join(who)}]"
            help_text = f"{f.metadata.get('help', '')} (default: {_defaults_text(registry, fname, who)}){applies}"
            if typ is bool:
                decl = typer.Option(f"{flag}/--no-{flag[2:]}", help=help_text, show_default=False)
            else:
                decl = typer.Option(flag, help=help_text, show_default=False)
            ann = typing.Annotated[Optional[typ], decl]
            new_params.append(inspect.Parameter(fname, inspect.Parameter.KEYWORD_ONLY, default=None,
                                                annotation=ann))
            annotations[fname] = ann

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            method = kwargs.pop("method")
            given = {}
            for fname in converters:
                v = kwargs.pop(fname, None)
                if v is not None:
                    given[fname] = converters[fname](v)
            kwargs[param] = registry.build(method, **given)
            return func(*args, **kwargs)

        # Typer reads keyword-only and positional-or-keyword parameters alike; the command's own come first.
        wrapper.__signature__ = sig.replace(parameters=[*own, *new_params])  # type: ignore[attr-defined]
        wrapper.__annotations__ = annotations
        wrapper.registry = registry  # type: ignore[attr-defined]
        return wrapper

    return deco
