"""The run's config tree: dataclasses with a docstring under every field, YAML recipes, dotted overrides.

Each component keeps its config dataclass next to its code (`trainer/`, `rollout/`, ...); this module
holds the machinery that builds any of them from plain data and the root `RunConfig` that gathers
them. Errors name the offending field by its dotted path, the YAML file and line where it came from,
and for an unknown key the closest valid one.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import difflib
import functools
import inspect
import math
import errno
import os
import stat
import subprocess
import textwrap
import types
import typing
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config value or key is wrong. The message names the field, and where known the file and line."""

    def __init__(self, message: str, field: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.field = field
        self.reason = reason


class InfrastructureError(RuntimeError):
    """The machines or processes a run depends on failed past recovery (e.g. every rollout engine dead): not the
    user's input and not a bug; the CLI reports it in one line naming what failed and exits 1."""


T = TypeVar("T")


@dataclasses.dataclass
class Source:
    """Where config values came from: a YAML file (key -> line) or the command line."""

    file: str | None = None
    lines: dict[str, int] = dataclasses.field(default_factory=dict)
    overrides: set[str] = dataclasses.field(default_factory=set)

    def where(self, path: str) -> str:
        if path in self.overrides:
            return f"command-line override '{path}'"
        probe = path
        while probe:
            if probe in self.lines:
                return f"{self.file}:{self.lines[probe]}"
            probe = probe.rpartition(".")[0]
        return self.file or "config"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (and of its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        docs.update(_class_field_docs(klass))
    return docs


@functools.lru_cache(maxsize=None)
def _class_field_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, following in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _type_hints(cls: type) -> dict[str, Any]:
    module = inspect.getmodule(cls)
    return typing.get_type_hints(cls, globalns=vars(module) if module else None)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str, source: Source) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path, source)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # `X | None`: X's own message says what is wrong
            raise errors[0]
        raise ConfigError(f"{source.where(path)}: field '{path}' = {value!r} does not fit {_type_name(tp)}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source.where(path)}: field '{path}' = {value!r} is not one of {list(args)}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source.where(path)}: section '{path}' must be a mapping, got {value!r}")
        return _build(tp, value, path, source)
    if origin in (list, Sequence, tuple) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source.where(path)}: field '{path}' must be a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [_convert(v, item_type, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source.where(path)}: field '{path}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source.where(path)}: field '{path}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source.where(path)}: field '{path}' must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e-6" (no dot) as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{source.where(path)}: field '{path}' must be a number, got {value!r}")
        # No field of ours means anything by inf or nan; taken, they surface steps later as inf weights.
        if not math.isfinite(number):
            raise ConfigError(f"{source.where(path)}: field '{path}' must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source.where(path)}: field '{path}' must be a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{source.where(path)}: field '{path}' has unsupported type {_type_name(tp)}")


def _build(cls: type[T], data: Mapping[str, Any], prefix: str, source: Source) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _type_hints(cls)
    kwargs = {}
    # A field marked IMPORTS_FIELD lists modules that register extension parts by name: they are
    # imported before the other fields are built, whose validation must know those names.
    importing = {name for name, f in fields.items() if f.metadata.get(IMPORTS_FIELD)}
    for key, value in sorted(data.items(), key=lambda item: item[0] not in importing):
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
            section = f"section '{prefix}'" if prefix else "the top level"
            raise ConfigError(f"{source.where(path)}: unknown key '{path}' in {section}{hint} "
                              f"(valid keys: {', '.join(sorted(fields))})")
        kwargs[key] = _convert(value, hints[key], path, source)
        if fields[key].metadata.get(RECIPE_PATH_FIELD) and isinstance(kwargs[key], str):
            kwargs[key] = recipe_relative(kwargs[key], path, source)
        elif fields[key].metadata.get(RECIPE_PATH_FIELD) and isinstance(kwargs[key], list):
            kwargs[key] = [recipe_relative(v, path, source) if isinstance(v, str) else v for v in kwargs[key]]
        if key in importing:
            import_modules(kwargs[key], path, source)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if exc.field is None:
            raise
        path = f"{prefix}.{exc.field}" if prefix else exc.field
        raise ConfigError(f"{source.where(path)}: field '{path}': {exc.reason}") from None
    except TypeError:  # a required field is missing
        missing = [n for n, f in fields.items() if n not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            names = ", ".join(f"'{prefix + '.' if prefix else ''}{m}'" for m in missing)
            raise ConfigError(f"{source.where(prefix)}: missing required field {names}") from None
        raise


def from_dict(cls: type[T], data: Mapping[str, Any] | None, source: Source | None = None) -> T:
    """Build config dataclass `cls` from plain data, checking keys and types recursively."""
    return _build(cls, data or {}, "", source or Source())


def to_dict(config: Any) -> dict[str, Any]:
    """Plain data (YAML-safe) for a config dataclass."""
    return dataclasses.asdict(config)


MAX_YAML_VALUES = 100_000
"""Most values a YAML text may hold once its aliases are expanded: an alias bomb (a few lines whose aliases
nest into billions of values) is refused before anything walks it."""


def _expanded_size(node: Any, memo: dict[int, int]) -> int:
    """How many values `node` stands for with every alias expanded (linear time: shared nodes counted once
    each, by memo; capped just past the bound)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_YAML_VALUES + 1  # a cycle counts as too large
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, memo)
        if size > MAX_YAML_VALUES:
            break
    memo[id(node)] = size
    return size


def _bounded_yaml(text: str, where: str) -> Any:
    """The YAML node of `text`, refused when its aliases expand past MAX_YAML_VALUES."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
        raise ConfigError(f"{where}: the YAML's aliases expand to more than {MAX_YAML_VALUES:,} values (an alias "
                          "bomb?); write the values out")
    return node


def _yaml_with_lines(text: str, file: str) -> tuple[Any, dict[str, int]]:
    """Parse YAML, also returning the 1-based line of every mapping key by dotted path."""
    try:
        node = _bounded_yaml(text, file)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else file
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:  # deeply nested flow collections
        raise ConfigError(f"{file}: invalid YAML: nested too deeply") from None
    lines: dict[str, int] = {}

    def walk(n: Any, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                if path in lines and isinstance(key_node, yaml.ScalarNode):
                    # PyYAML keeps the last of duplicate keys silently; the user meant one of them.
                    raise ConfigError(f"{file}:{key_node.start_mark.line + 1}: duplicate key '{path}' "
                                      f"(first set at line {lines[path]})")
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    walk(node, "")
    return data, lines


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` -> (['trainer', 'lr'], 1e-06). The value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"command-line override {text!r} must look like section.field=value")
    try:
        if raw.strip():
            _bounded_yaml(raw, f"command-line override {key.strip()}")
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def merge_overrides(data: dict[str, Any], overrides: Sequence[str], source: Source) -> dict[str, Any]:
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"command-line override {text!r}: '{key}' is not a section")
            node = child
        node[keys[-1]] = value
        source.overrides.add(".".join(keys))
    return data


def split_config_and_overrides(config: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """Command lines may omit the recipe: `megatron-rl eval model.path=X` has an override where the
    YAML path would be."""
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, list(overrides)


def load_yaml_data(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> tuple[dict[str, Any], Source]:
    """A YAML recipe's mapping with dotted `section.field=value` overrides applied, not yet validated, and
    where its values came from (for messages)."""
    source = Source()
    data: dict[str, Any] = {}
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        parsed, lines = _yaml_with_lines(read_text(path, "config file"), path)
        if parsed is not None and not isinstance(parsed, dict):
            raise ConfigError(f"{path}:1: the top level of a config must be a mapping")
        data = parsed or {}
        source = Source(file=path, lines=lines)
    return merge_overrides(data, overrides, source), source


def load_yaml(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Load a YAML recipe into `cls`, applying dotted `section.field=value` overrides on top."""
    data, source = load_yaml_data(path, overrides)
    return from_dict(cls, data, source)


def read_text(path: str, what: str) -> str:
    """A user's UTF-8 text file; a ConfigError naming `what`, the file and the byte for any other
    encoding (a UTF-8 byte-order mark is dropped)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: {what} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: {what} is a directory, not a file") from None


def dump_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per field, `path: type = default  # doc`, for `megatron-rl config --describe`."""
    lines = []
    docs = field_docs(cls)
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{path}:  # {docs.get(f.name, '')}")
            lines.extend(describe(tp, path + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
        lines.append(f"{path}: {_type_name(tp)} = {default!r}  # {docs.get(f.name, '').splitlines()[0] if docs.get(f.name) else ''}")
    return lines


def path_kind(path: str) -> str:
    """What is at `path`, in words, for a message about a path that cannot be used as the file or directory
    it should be: "missing", "a directory", "a regular file", "a symbolic link loop", "a symbolic link to
    'X', which does not exist", "a named pipe (FIFO)", "a socket", "a device"."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(mode):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        except OSError as exc:
            return "a symbolic link loop" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a device"


def require(condition: bool, field: str, message: str) -> None:
    """Validation helper for `__post_init__`: raise a ConfigError naming `field`."""
    if not condition:
        raise ConfigError(f"field '{field}': {message}", field=field, reason=message)


def _import_failure(module_name: str, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"cannot import module {module_name!r}: {exc}"
    return f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"


def _import_module(module_name: str):
    """importlib.import_module, with any failure of the user's module (a syntax error, an exception or a
    SystemExit at import) as a ValueError saying what failed."""
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise ValueError(_import_failure(module_name, exc)) from None


@functools.lru_cache(maxsize=None)
def interpreter_has_module(python: str, module: str) -> bool:
    """Whether the interpreter `python` finds `module` (looked up, not imported: one interpreter start):
    for a library that runs in an environment of its own (vLLM, verifiers)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def import_object(spec: str, what: str):
    """The object a 'package.module:attr' path names (a user's reward, objective, ...); ValueError naming
    `what` and the path when the module does not import or lacks the attribute. The one place a spec
    is imported: every `Registry` resolves through it."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = _import_module(module_name)
    except ValueError as exc:
        raise ValueError(f"{what} {spec!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


# Metadata key of a config field listing modules to import before the rest of its section is built.
IMPORTS_FIELD = "megatron_rl.imports"

# A field marked RECIPE_PATH_FIELD (metadata={RECIPE_PATH_FIELD: True}) holds a path to an input file that a
# recipe may name relative to itself (recipe_relative).
RECIPE_PATH_FIELD = "megatron_rl.recipe_path"


def recipe_relative(value: str, path: str, source: Source) -> str:
    """A relative path written in a recipe file names the file beside the recipe when one exists there (so
    a recipe works from any directory); otherwise, and on the command line, it is relative to the working
    directory as before. `~` is the home directory. Names that are not paths (a model preset) pass through."""
    value = os.path.expanduser(value)
    if (os.path.isabs(value) or "://" in value or source.file is None or path in source.overrides
            or os.path.exists(value)):
        return value
    beside = os.path.join(os.path.dirname(os.path.abspath(source.file)), value)
    return beside if os.path.exists(beside) else value


def import_modules(modules: Sequence[str], path: str = "imports", source: Source | None = None) -> None:
    """Import each module of a config's `imports:` list (their decorators register extension parts); a
    ConfigError naming where the list was set and what failed to import."""
    for module in modules:
        try:
            _import_module(module)
        except ValueError as exc:
            where = (source or Source()).where(path)
            raise ConfigError(f"{where}: field '{path}': {exc}") from None


class Registry:
    """The names one extension point answers to (a policy loss, an advantage estimator, a reward, ...).

    Built-ins are 'package.module:attr' specs imported on first `resolve`, so validating a config that
    names one imports nothing (no torch). A user part is registered under a name with the `register`
    decorator (in a module the run's `imports:` lists), or named directly as 'package.module:attr'."""

    def __init__(self, what: str, builtins: Mapping[str, str] | None = None):
        self.what = what
        self._specs: dict[str, str] = dict(builtins or {})
        self._objects: dict[str, Any] = {}

    def register(self, name: str):
        """Decorator: register the decorated object under `name`; a name already taken is refused."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.what} name {name!r}: must be a non-empty string without ':'")

        def wrap(obj):
            if name in self:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self._objects[name] = obj
            return obj

        return wrap

    def unregister(self, name: str) -> None:
        """Drop a registered (not built-in) name, e.g. after a test."""
        if name in self._specs:
            raise ValueError(f"{self.what} {name!r} is built in")
        self._objects.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._specs) | set(self._objects))

    def __contains__(self, name: object) -> bool:
        return name in self._specs or name in self._objects

    def __iter__(self):
        return iter(self.names())

    def _unknown(self, name: str, also: Sequence[str] = ()) -> str:
        known = sorted([*also, *self.names()])
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.what} {name!r}{hint}; registered: {known}, or a user {self.what} as 'package.module:name'"

    def _load(self, spec: str):
        obj = import_object(spec, self.what)
        if not callable(obj):
            raise ValueError(f"{self.what} {spec!r}: {spec.partition(':')[2]!r} is not callable")
        return obj

    def check(self, name: str, field: str, *, also: Sequence[str] = ()) -> None:
        """`__post_init__` validation of a field naming a part: a registered or built-in name (or one of
        `also`, names the caller handles itself), or a 'package.module:attr' that imports now, so a typo
        is named before the run starts. A ConfigError naming `field` otherwise."""
        if name in also or name in self:
            return
        require(":" in name, field, self._unknown(name, also))
        try:
            self._load(name)
        except ValueError as exc:
            require(False, field, str(exc))

    def resolve(self, name: str):
        """The object `name` names: registered, built in (imported now, once), or 'package.module:attr'."""
        if name in self._objects:
            return self._objects[name]
        if name in self._specs:
            obj = self._objects[name] = import_object(self._specs[name], self.what)
            return obj
        if ":" not in name:
            raise ValueError(self._unknown(name))
        return self._load(name)
