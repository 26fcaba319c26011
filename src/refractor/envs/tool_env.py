"""``ToolEnvironment``: a multi-turn environment whose environment turns execute tool calls.

Tools are plain Python callables (sync or async). Each model turn's calls are executed in order;
their results go back as one ``user`` message (``turn_type="tool_result"``). A turn without tool
calls is the final answer and ends the episode. Every call is recorded in ``state.custom`` and
exposed for logging through ``state.pop_pending_tool_calls()``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from refractor.envs.base import MultiTurnEnvironment
from refractor.envs.runners import run_blocking
from refractor.envs.tools import (
    ParsedToolCall,
    ToolCallFormat,
    format_tool_section,
    func_to_tool_schema,
    parse_function_tool_calls,
    parse_xml_tool_calls,
)
from refractor.records import PENDING_TOOL_CALLS, Messages, RolloutState, Sample, ToolCallRecord


def default_error_formatter(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class ToolEnvironment(MultiTurnEnvironment):
    """Subclasses implement ``load_dataset`` and ``compute_reward(state, eos_token)``."""

    def __init__(
        self,
        tools: list[Callable[..., Any]] | None = None,
        max_turns: int = 10,
        tool_call_format: ToolCallFormat = "xml",
        include_tool_schemas_in_prompt: bool = True,
        error_formatter: Callable[[BaseException], str] | None = None,
        system_prompt: str | None = None,
        tool_timeout_s: float = 60.0,
        max_tool_result_chars: int = 10_000,
        **kwargs: Any,
    ) -> None:
        if tool_call_format not in ("xml", "function"):
            raise ValueError(f"tool_call_format must be 'xml' or 'function', got {tool_call_format!r}")
        super().__init__(max_turns=max_turns, system_prompt=system_prompt, **kwargs)
        self.tools: dict[str, Callable[..., Any]] = {}
        for tool in tools or []:
            self.add_tool(tool)
        self.tool_call_format = tool_call_format
        self.include_tool_schemas_in_prompt = include_tool_schemas_in_prompt
        self.error_formatter = error_formatter or default_error_formatter
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_result_chars = max_tool_result_chars

    def add_tool(self, tool: Callable[..., Any]) -> None:
        if tool.__name__ in self.tools:
            raise ValueError(f"{type(self).__name__}: two tools are named {tool.__name__!r}")
        self.tools[tool.__name__] = tool

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [func_to_tool_schema(tool) for tool in self.tools.values()]

    def full_system_prompt(self) -> str | None:
        if not (self.include_tool_schemas_in_prompt and self.tools):
            return self.system_prompt
        section = format_tool_section(self.tool_schemas, self.tool_call_format)
        return f"{self.system_prompt}\n\n{section}" if self.system_prompt else section

    def get_initial_prompt(self, sample: Sample, tokenizer: Any = None) -> Messages:
        messages = (
            [dict(m) for m in sample.prompt]
            if isinstance(sample.prompt, list)
            else [{"role": "user", "content": sample.prompt}]
        )
        system = self.full_system_prompt()
        if system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        return messages

    # ----- calls -----------------------------------------------------------------------------
    def parse_tool_calls(self, completion: str) -> list[ParsedToolCall]:
        if self.tool_call_format == "xml":
            return parse_xml_tool_calls(completion)
        return parse_function_tool_calls(completion, list(self.tools))

    def is_final_answer(self, completion: str, state: RolloutState) -> bool:
        return not self.parse_tool_calls(completion)

    async def execute_tool(self, call: ParsedToolCall) -> ToolCallRecord:
        record = ToolCallRecord(
            tool_name=call.name,
            arguments=json.dumps(call.arguments, default=str),
            raw_text=call.raw_text,
            started_at=time.time(),
        )
        try:
            return await self._execute(call, record)
        finally:
            record.ended_at = time.time()

    async def _execute(self, call: ParsedToolCall, record: ToolCallRecord) -> ToolCallRecord:
        tool = self.tools.get(call.name)
        if tool is None:
            record.success = False
            record.error = "unknown_tool"
            record.result = (
                f"Unknown tool '{call.name}'. Available tools: {', '.join(self.tools) or '(none)'}"
            )
            return record
        positional = [call.arguments[k] for k in sorted((k for k in call.arguments if k.isdigit()), key=int)]
        keywords = {k: v for k, v in call.arguments.items() if not k.isdigit()}
        try:
            if inspect.iscoroutinefunction(tool):
                value = await asyncio.wait_for(tool(*positional, **keywords), self.tool_timeout_s)
            else:
                value = await asyncio.wait_for(
                    run_blocking(tool, *positional, **keywords), self.tool_timeout_s
                )
            record.result = value if isinstance(value, str) else json.dumps(value, default=str)
        except TimeoutError:
            record.success = False
            record.error = "timeout"
            record.result = self.error_formatter(
                TimeoutError(f"{call.name} took longer than {self.tool_timeout_s:g}s")
            )
        except TypeError as err:
            record.success = False
            record.error = "argument_error"
            record.result = self.error_formatter(err)
        except Exception as err:  # a tool failure is reported to the model, not raised
            record.success = False
            record.error = type(err).__name__
            record.result = self.error_formatter(err)
        if len(record.result) > self.max_tool_result_chars:
            record.result = record.result[: self.max_tool_result_chars] + "\n...[truncated]"
            record.truncated = True
        return record

    @staticmethod
    def format_tool_results(records: list[ToolCallRecord]) -> str:
        lines = [f"[{r.tool_name}] {'' if r.success else 'Error: '}{r.result}" for r in records]
        if len(lines) == 1:
            return lines[0]
        return "\n".join(f"Tool {i}: {line}" for i, line in enumerate(lines, start=1))

    # ----- turn protocol ---------------------------------------------------------------------
    async def env_response(self, messages: Messages, state: RolloutState) -> Messages:
        completion = str(messages[-1].get("content") or "")
        calls = self.parse_tool_calls(completion)
        if not calls or self.is_final_answer(completion, state):
            state.custom["_no_more_turns"] = True
            return []
        records = [await self.execute_tool(call) for call in calls]  # sequential, in order
        custom = state.custom
        custom.setdefault("tool_calls", []).extend({"name": c.name, "arguments": c.arguments} for c in calls)
        custom.setdefault("tool_results", []).extend(r.result for r in records)
        custom["tool_success_count"] = custom.get("tool_success_count", 0) + sum(r.success for r in records)
        custom["tool_error_count"] = custom.get("tool_error_count", 0) + sum(not r.success for r in records)
        by_name = custom.setdefault("tools_by_name", {})
        for r in records:
            if r.tool_name in self.tools:
                by_name[r.tool_name] = by_name.get(r.tool_name, 0) + 1
        custom.setdefault(PENDING_TOOL_CALLS, []).extend(records)
        return [{"role": "user", "content": self.format_tool_results(records), "turn_type": "tool_result"}]

    def is_done(self, state: RolloutState) -> tuple[bool, str | None]:
        if state.custom.get("_no_more_turns"):
            return True, "final_answer"
        return super().is_done(state)

    def get_tool_metrics(self, state: RolloutState) -> dict[str, float]:
        success = state.custom.get("tool_success_count", 0)
        errors = state.custom.get("tool_error_count", 0)
        total = success + errors
        by_name = Counter(state.custom.get("tools_by_name", {}))
        metrics = {
            "total_tool_calls": float(total),
            "tool_success_count": float(success),
            "tool_error_count": float(errors),
            "tool_success_rate": success / total if total else 0.0,
            "unique_tools_used": float(len(by_name)),
        }
        metrics.update({f"{name}_calls": float(by_name.get(name, 0)) for name in self.tools})
        return metrics
