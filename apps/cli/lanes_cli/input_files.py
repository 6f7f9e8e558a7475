"""Reading the files a user hands the CLI (job specs, drill plans, topologies): bounded, text only, strict YAML.

Each problem is one line on stderr and exit code 2, naming the file. The bounds are in `lanes_cli.limits`.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lanes_cli.console import EXIT_BAD_INPUT, fail
from lanes_cli.limits import MAX_PROBLEMS_SHOWN, MAX_SPEC_BYTES, InputLimitError, check_yaml_shape
from lanes_contract.errors import LanesError

__all__ = [
    "MAX_SPEC_BYTES",
    "InputFileError",
    "UniqueKeyLoader",
    "check_document",
    "load_yaml",
    "parse_yaml",
    "read_text_file",
    "validation_problems",
]


class UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice (YAML would silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping, or a ConstructorError naming the key given twice and its line."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                msg = f"a {type(key).__name__} as a key (line {key_node.start_mark.line + 1}); keys are names"
                raise yaml.constructor.ConstructorError(None, None, msg, key_node.start_mark)
            if key in seen:
                msg = f"duplicate key {key!r} (line {key_node.start_mark.line + 1})"
                raise yaml.constructor.ConstructorError(None, None, msg, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_text_file(path: Path, *, max_bytes: int = MAX_SPEC_BYTES, what: str = "a job spec is YAML or JSON") -> str:
    """The text of a regular file of at most `max_bytes`, UTF-8; else exit 2 saying why (`what` says what it is)."""
    try:
        if not path.exists():
            fail(f"cannot read {path}: no such file or directory", EXIT_BAD_INPUT)
        if not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file"
            fail(f"{path} is {kind}; {what}", EXIT_BAD_INPUT)
        with path.open("rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", EXIT_BAD_INPUT)
    if len(raw) > max_bytes:
        fail(f"{path} is larger than the limit of {max_bytes // 1024} KiB; {what}", EXIT_BAD_INPUT)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "\x00"
    if "\x00" in text:
        fail(f"{path} is not a text file (binary content); {what}", EXIT_BAD_INPUT)
    return text


class InputFileError(LanesError, ValueError):
    """A file's content that cannot be used (bad YAML, beyond a bound, not a spec); the message says why."""


def parse_yaml(text: str) -> Any:
    """The YAML (or JSON) document of `text`, with no key given twice and its shape bounded; else InputFileError."""
    try:
        check_yaml_shape(text)
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass, its shape bounded
    except InputLimitError as exc:
        raise InputFileError(str(exc)) from exc
    except yaml.YAMLError as exc:
        raise InputFileError(f"not valid YAML: {' '.join(str(exc).split())}") from exc


def load_yaml(path: Path) -> Any:
    """The file's YAML (or JSON) document, with no key given twice; else exit 2 saying why."""
    text = read_text_file(path)
    try:
        return parse_yaml(text)
    except InputFileError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)


def check_document(path: Path, *, what: str) -> None:
    """Exit 2 unless the file is a text file within MAX_SPEC_BYTES whose YAML or JSON shape is bounded.

    For a document another component then reads itself (a keyring): refused here before it is parsed.
    """
    try:
        check_yaml_shape(read_text_file(path, what=what))
    except InputLimitError as exc:
        fail(f"{path}: {exc}", EXIT_BAD_INPUT)


def validation_problems(exc: ValidationError, whole: str = "spec") -> str:
    """The problems pydantic found, on one line: `workers: Input should be greater than 0; ...`.

    At most MAX_PROBLEMS_SHOWN are named (a file of a thousand unknown keys is not repeated back), then how
    many more there are.
    """
    problems = [f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}".replace("\n", " ") for e in exc.errors()]
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (f"; and {more} more" if more > 0 else "")
