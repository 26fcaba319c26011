"""Tool calling helpers: JSON schemas from Python functions, the system-prompt tool section, and
parsers for the two call formats (``xml``: ``<tool_call>{"name", "arguments"}</tool_call>``;
``function``: ``name(arg=..., ...)`` with literal arguments only)."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)
ToolCallFormat = Literal["xml", "function"]


@dataclass
class ParsedToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw_text: str = ""


# ----- schemas ---------------------------------------------------------------------------------
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


def type_to_schema(hint: Any) -> dict[str, Any]:
    """JSON schema of a type hint; unknown or missing hints are strings."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return type_to_schema(non_none[0]) if len(non_none) == 1 else {"type": "string"}
    if origin is Literal:
        return {"type": _SCALARS.get(type(args[0]), "string"), "enum": list(args)}
    if hint is list or origin in (list, tuple, set):
        return {"type": "array", "items": type_to_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {"type": "string"}


def _split_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Summary text and per-parameter descriptions from a Google-style ``Args:`` section."""
    lines = inspect.cleandoc(doc).splitlines()
    summary = []
    params = {}
    current = None
    in_args = False
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args and re.match(r"^(returns?|raises|yields|examples?):$", stripped.lower()):
            in_args = False
            continue
        if in_args:
            match = re.match(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", stripped)
            if match and not line.startswith(" " * 8):
                current = match.group(1).lstrip("*")
                params[current] = match.group(3)
            elif current and stripped:
                params[current] += " " + stripped
        else:
            summary.append(line)
    return "\n".join(summary).strip(), params


def func_to_tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI function-tool schema: name, docstring summary, parameters from type hints
    (required = no default; descriptions from an ``Args:`` docstring section when present)."""
    description, param_docs = _split_docstring(inspect.getdoc(func) or "")
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolved forward references: fall back to strings
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(func).parameters.items():
        if name in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema = type_to_schema(hints.get(name, str))
        if name in param_docs:
            schema["description"] = param_docs[name]
        properties[name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": func.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def format_tool_section(schemas: list[dict[str, Any]], call_format: ToolCallFormat) -> str:
    """Markdown appended to the system prompt: the tools, then how to call them."""
    parts = ["# Available Tools", ""]
    for schema in schemas:
        fn = schema["function"]
        parts += [f"## {fn['name']}", fn["description"] or "(no description)", "", "**Parameters:**"]
        props = fn["parameters"]["properties"]
        required = set(fn["parameters"]["required"])
        if not props:
            parts.append("- (none)")
        for pname, pschema in props.items():
            line = f"- `{pname}` ({pschema['type']}{', required' if pname in required else ''})"
            parts.append(line + (f": {pschema['description']}" if pschema.get("description") else ""))
        parts.append("")
    parts += ["# Tool Call Format", ""]
    if call_format == "xml":
        parts += [
            "To call a tool, write a JSON object inside tool_call tags:",
            '<tool_call>{"name": "tool_name", "arguments": {"arg": "value"}}</tool_call>',
            "You may make several calls in one message; results come back in the next message.",
        ]
    else:
        parts += [
            "To call a tool, write a Python-style call with literal arguments:",
            'tool_name(arg="value", other=3)',
            "You may make several calls in one message; results come back in the next message.",
        ]
    parts.append("When you are done, answer normally without any tool call.")
    return "\n".join(parts)


# ----- parsing ---------------------------------------------------------------------------------
_XML_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.IGNORECASE | re.DOTALL)


def parse_xml_tool_calls(text: str) -> list[ParsedToolCall]:
    """Every ``<tool_call>`` whose body is JSON ``{"name": str, "arguments": {...}}``."""
    calls = []
    for match in _XML_CALL.finditer(text):
        try:
            body = json.loads(match.group(1).strip())
        except json.JSONDecodeError:
            logger.warning("skipping tool call with invalid JSON: %.200s", match.group(1))
            continue
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            args = body.get("arguments") or {}
            if isinstance(args, str):  # some models double-encode the arguments
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {"0": args}
            calls.append(
                ParsedToolCall(body["name"], args if isinstance(args, dict) else {"0": args}, match.group(0))
            )
    return calls


def _literal(node: ast.AST) -> Any:
    """Literals only: constants, containers, unary +/- (no names, calls or attribute access)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(e) for e in node.elts]
        return (
            items
            if isinstance(node, ast.List)
            else tuple(items)
            if isinstance(node, ast.Tuple)
            else set(items)
        )
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _literal(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    raise ValueError(f"non-literal argument: {ast.dump(node)[:80]}")


def _call_end(text: str, open_idx: int) -> int | None:
    """Index after the parenthesis closing ``text[open_idx]``, skipping string literals."""
    depth = 0
    i = open_idx
    while i < len(text):
        for quote in ('"""', "'''", '"', "'"):
            if text.startswith(quote, i):
                end = i + len(quote)
                while end < len(text) and not text.startswith(quote, end):
                    end += 2 if text[end] == "\\" else 1
                i = end + len(quote)
                break
        else:
            if text[i] in "([{":
                depth += 1
            elif text[i] in ")]}":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
    return None


def parse_function_tool_calls(text: str, tool_names: list[str]) -> list[ParsedToolCall]:
    """``name(...)`` calls of known tools; positional arguments are stored under "0", "1", ..."""
    if not tool_names:
        return []
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(n) for n in tool_names) + r")\s*\(")
    calls = []
    pos = 0
    while (match := pattern.search(text, pos)) is not None:
        end = _call_end(text, match.end() - 1)
        if end is None:
            break
        raw = text[match.start() : end]
        pos = end
        try:
            node = ast.parse(raw, mode="eval").body
            assert isinstance(node, ast.Call)
            args = {str(i): _literal(a) for i, a in enumerate(node.args)}
            args.update({kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg})
        except (SyntaxError, ValueError, AssertionError, TypeError) as err:
            logger.warning("skipping unparsable tool call %.120s: %s", raw, err)
            continue
        calls.append(ParsedToolCall(match.group(1), args, raw))
    return calls
