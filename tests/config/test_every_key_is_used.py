"""No accepted key that does nothing: every key of the schema is read by the code it configures, or
listed in ``IGNORED_KEYS`` (the loader then prints a notice naming it and why it has no effect).

A read is found in the source of ``src/refractor`` (the schema itself excluded: it names every key):
``cfg.<key>`` (the run config travels as ``cfg``), ``getattr(cfg, "<key>")``, a derived member of
``RefractorConfig`` (``cfg.num_inference_servers`` reads ``inference_num_workers``), or one of the
settings dataclasses that read ``getattr(cfg, name)`` for each of their field names.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path

import pytest

import refractor
from refractor.algorithms.advantages import AdvantageSettings
from refractor.algorithms.filters import FilterSettings
from refractor.algorithms.loss import LossSettings
from refractor.config.loader import ignored_key_notices
from refractor.config.schema import IGNORED_KEYS, RefractorConfig
from refractor.trainer.settings import TrainerSettings

SRC = Path(refractor.__file__).parent
SCHEMA = SRC / "config" / "schema.py"
CONFIG_NAME = "cfg"  # how a RefractorConfig is named where it is read (never `config`, `c`, `self.x`)


def _field_names(cls: type) -> Callable[[], set[str]]:
    return lambda: {f.name for f in fields(cls)}


# The readers of `getattr(cfg, <name computed at run time>)`, and the keys each one reads. A new
# generic reader fails `test_every_generic_read_is_a_known_reader` until it is listed here.
GENERIC_READERS: dict[str, Callable[[], set[str]]] = {
    "trainer/settings.py": lambda: set(TrainerSettings.config_keys()),
    "algorithms/filters.py": _field_names(FilterSettings),
    "algorithms/loss.py": _field_names(LossSettings),
    "algorithms/advantages.py": _field_names(AdvantageSettings),
}

# Keys with an effect although no code reads their value; each says why.
_MEGATRON_VALIDATED = (
    "validated only: refractor's Megatron trainer runs its one supported value (docs/megatron.md)"
)
READ_ELSEWHERE: dict[str, str] = {
    key: _MEGATRON_VALIDATED
    for key in (
        "megatron_use_transformer_engine",
        "megatron_fp8",
    )
}


def _trees(root: Path = SRC) -> Iterable[tuple[str, ast.AST]]:
    for path in sorted(root.rglob("*.py")):
        if path != SCHEMA:
            yield path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _is_config(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == CONFIG_NAME


def _getattr_of_config(node: ast.AST) -> ast.expr | None:
    """The name argument of ``getattr(cfg, name[, default])``, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and _is_config(node.args[0])
    ):
        return node.args[1]
    return None


def attributes_read(trees: Iterable[tuple[str, ast.AST]]) -> tuple[set[str], set[str]]:
    """(names read off ``cfg``, files that read names computed at run time)."""
    names: set[str] = set()
    generic: set[str] = set()
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_config(node.value):
                names.add(node.attr)
            name = _getattr_of_config(node)
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names.add(name.value)
            elif name is not None:
                generic.add(rel)
    return names, generic


def derived_members(schema_source: str) -> dict[str, set[str]]:
    """RefractorConfig's own properties and methods -> the keys each reads (``self.<key>``)."""
    tree = ast.parse(schema_source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RefractorConfig"]
    members = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_"):
            members[fn.name] = {
                n.attr
                for n in ast.walk(fn)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            }
    return members


def keys_read(keys: Iterable[str], trees: Iterable[tuple[str, ast.AST]], schema_source: str) -> set[str]:
    names, generic_files = attributes_read(trees)
    read = set(names)
    for member, member_keys in derived_members(schema_source).items():
        if member in names:
            read |= member_keys
    for rel in generic_files & GENERIC_READERS.keys():
        read |= GENERIC_READERS[rel]()
    return read & set(keys)


@pytest.fixture(scope="module")
def read() -> set[str]:
    return keys_read(RefractorConfig.model_fields, _trees(), SCHEMA.read_text(encoding="utf-8"))


def test_every_key_is_read_or_has_a_notice(read):
    unaccounted = sorted(
        set(RefractorConfig.model_fields) - read - IGNORED_KEYS.keys() - READ_ELSEWHERE.keys()
    )
    assert not unaccounted, (
        f"accepted but read nowhere: {unaccounted}. Make each work (read it where it means something) or "
        "list it in IGNORED_KEYS (config/schema.py) with why it has no effect, and in docs/config.md"
    )


def test_no_key_listed_as_ignored_is_read(read):
    """An ignored key that code now reads would print a false notice."""
    assert not sorted(read & IGNORED_KEYS.keys())
    assert not sorted(read & READ_ELSEWHERE.keys())
    assert set(IGNORED_KEYS) <= set(RefractorConfig.model_fields)


def test_every_generic_read_is_a_known_reader():
    _, generic_files = attributes_read(_trees())
    assert generic_files == set(GENERIC_READERS), (
        "getattr(cfg, <computed name>) outside the known readers: list the file and the keys it reads "
        "in GENERIC_READERS"
    )


def test_a_key_that_nothing_reads_is_found(tmp_path):
    """The search is precise enough to miss a new key no code reads, even one named like an attribute
    that other objects have (`self.settings.x`, `config.x` of an engine)."""
    (tmp_path / "module.py").write_text(
        "def f(cfg, settings, config):\n"
        "    return cfg.seq_len, getattr(cfg, 'top_p'), settings.new_key, config.other_key, "
        "cfg.num_inference_servers\n"
    )
    schema = (
        "class RefractorConfig:\n"
        "    @property\n"
        "    def num_inference_servers(self):\n"
        "        return self.inference_num_workers // self.inference_tensor_parallel_size\n"
        "    def unused_member(self):\n"
        "        return self.unused_key\n"
    )
    keys = {
        "seq_len",
        "top_p",
        "new_key",
        "other_key",
        "inference_num_workers",
        "inference_tensor_parallel_size",
        "unused_key",
    }
    read = keys_read(keys, _trees(tmp_path), schema)
    assert read == {"seq_len", "top_p", "inference_num_workers", "inference_tensor_parallel_size"}


@pytest.mark.parametrize("key", sorted(IGNORED_KEYS))
def test_an_ignored_key_set_by_the_user_prints_one_notice_naming_it(key):
    cfg = RefractorConfig(environments=[{"name": "countdown"}])
    cfg._user_keys = frozenset({key, "seq_len"})
    (notice,) = ignored_key_notices(cfg)
    assert f"`{key}`" in notice and notice.endswith(IGNORED_KEYS[key])
