"""Configs: dataclass sections with defaults, a Python config file, then `--section.field=value`.

A trainer declares its knobs as small dataclasses at the top of its file (one comment per field) and
calls `parse(sections, argv)`: config files (plain Python run with the sections as globals:
`loss.beta = 0.0`), then overrides. A typo names the closest valid key (`loss.bta` -> did you mean
`loss.beta`?), a wrong type names the field, a stray top-level name in a config file is an error (a
silent new variable is how a long run trains with the wrong settings). Cross-field checks are the
trainer's; `--help` and `--print-config` are run.py's.

What a user brings (a loss, an advantage estimator, a reward, an env, a dataset) is named in a
config the same way, and resolved by one function, `named`: a built-in's name, or
"package.module:Name" / "path/to/file.py:Name".
"""
import ast
import dataclasses
import difflib
import importlib
import os
import sys
import typing
from pathlib import Path


class ConfigError(ValueError):
    pass


FLAGS = ("--help", "-h", "--print-config")  # not overrides: run.parse_cli acts on them


def _closest(name, options, prefix=""):
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    valid = ", ".join(prefix + o for o in sorted(options))
    return f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid: {valid})"


def _check(section, name, value, typ):
    """Coerce CLI strings and check types: int is fine where float is wanted, None where
    Optional."""
    args = typing.get_args(typ)
    if type(None) in args:
        if value is None or value == "None":
            return None
        typ = next(a for a in args if a is not type(None))
    # `str | dict` (rollout.env): a CLI string is a dict only if it reads as one
    if str in args and len(args) > 1:
        if not (isinstance(value, str) and value.lstrip().startswith("{")):
            return value if isinstance(value, args) else _check(section, name, value, str)
        typ = next(a for a in args if a is not str)
    if isinstance(value, str) and typ is not str:
        try:
            value = value.lower() == "true" if typ is bool and value.lower() in ("true", "false") \
                else ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"{section}.{name}: cannot parse {value!r} as {getattr(typ, '__name__', typ)}")
    origin = typing.get_origin(typ) or typ
    ok = isinstance(value, origin) and not (origin in (int, float) and isinstance(value, bool))
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        value, ok = origin(value), True
    if not ok:
        raise ConfigError(
            f"{section}.{name}: expected {getattr(origin, '__name__', origin)}, got {value!r}")
    return value


class _Section:
    """Wraps a dataclass instance so that assigning an unknown field fails with a suggestion."""

    def __init__(self, name, obj):
        self.__dict__.update(_name=name, _obj=obj, _types=typing.get_type_hints(type(obj)))

    def _known(self, key):
        if key not in self._types:
            raise ConfigError("unknown config key "
                              f"'{self._name}.{key}'{_closest(key, self._types, self._name + '.')}")
        return key

    def __getattr__(self, key):
        return getattr(self._obj, self._known(key))

    def __setattr__(self, key, value):
        setattr(self._obj, self._known(key), _check(self._name, key, value, self._types[key]))


def run_file(path, scope, sections):
    """Run one config file in `scope` (the sections). Inside it, `include("tiny.py")` runs another
    config file, named relative to this one, right there: a recipe is its base config plus the lines
    that differ."""
    try:
        code = open(path).read()
    except OSError as e:
        raise ConfigError(f"config file not found: {path} ({e.strerror})") from None

    def include(name):
        run_file(os.path.join(os.path.dirname(path), name), scope, sections)
        scope["include"] = include  # the included file's own include() resolved relative to it
    scope["include"] = include
    try:
        exec(compile(code, path, "exec"), scope)
    except NameError as e:
        raise ConfigError(f"{path}: {e}{_closest(e.name, sections)}") from None


def parse(sections: dict, argv: list[str]) -> dict:
    """Config files (positional), then `--section.field=value` overrides, onto `sections`; FLAGS are
    the caller's."""
    wrapped = {name: _Section(name, obj) for name, obj in sections.items()}
    for arg in [a for a in argv if not a.startswith("-")]:  # config files first, in order
        scope = dict(wrapped)
        run_file(arg, scope, sections)
        stray = [k for k, v in scope.items() if k not in wrapped and not k.startswith("_")
                 and not isinstance(v, type(ast)) and k not in ("__builtins__", "include")]
        if stray:
            raise ConfigError(f"{arg}: top-level name '{stray[0]}' is not a config section"
                              f"{_closest(stray[0], sections)}; assign fields like "
                              "`loss.beta = 0.0`")
    # then the overrides, in order
    for arg in [a for a in argv if a.startswith("-") and a not in FLAGS]:
        key, eq, value = arg[2:].partition("=")
        section, _, field = key.partition(".")
        if not arg.startswith("--") or not eq or not field:
            raise ConfigError(f"bad override {arg!r}: expected --section.field=value (or --help)")
        if section not in wrapped:
            raise ConfigError(f"unknown config section '{section}'{_closest(section, sections)}")
        setattr(wrapped[section], field, value)
    return sections


def to_dict(sections: dict) -> dict:
    return {name: dataclasses.asdict(obj) for name, obj in sections.items()}


def load_object(spec, field):
    """A callable named in the config: "package.module:Name" (importable) or "path/to/file.py:Name"
    (imported by its file name, its directory put on sys.path, so a reward-pool worker can unpickle
    it). Else a ConfigError naming the field: the module does not import, has no such name, or the
    name is not callable."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name).resolve()
            if not file.is_file():
                raise FileNotFoundError(f"no such file: {module_name}")
            if str(file.parent) not in sys.path:
                sys.path.insert(0, str(file.parent))
            module = importlib.import_module(file.stem)
            # e.g. a user file named data.py: nanoforge's own
            if Path(module.__file__).resolve() != file:
                raise ImportError(
                    f"module name {file.stem!r} is taken by {module.__file__}; rename the file")
        else:
            module = importlib.import_module(module_name)
        obj = getattr(module, attr)
    # ImportError, FileNotFoundError, AttributeError, or whatever the module raised
    except Exception as e:
        raise ConfigError(f"{field}: cannot load {spec!r} ({type(e).__name__}: {e})") from None
    if not callable(obj):
        raise ConfigError(f"{field}: {spec!r} is a {type(obj).__name__}, not a callable or class")
    return obj


def named(spec, builtins, field, kind):
    """The one loader of what a config names: a key of `builtins` -> its value;
    "package.module:Name" or "path/to/file.py:Name" -> that object (load_object). Anything else
    fails naming the field and the closest built-in `kind` (loss, estimator, reward, env,
    dataset)."""
    if isinstance(spec, str) and spec in builtins:
        return builtins[spec]
    if isinstance(spec, str) and ":" in spec:
        return load_object(spec, field)
    raise ConfigError(f"{field}: unknown {kind} {spec!r}{_closest(str(spec), builtins)}; or name "
                      "your own as 'package.module:Name' or 'path/to/file.py:Name'")
