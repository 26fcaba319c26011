"""Browsing stored rollouts: one step's rollouts with filters, sorting and paging, one rollout in
full (turns, tool calls, environment answers), and the steps that have rollouts of a status."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from refractor.telemetry.query import RunReader
from refractor.telemetry.store import tokens_from_blob

# columns of a rollout listing: everything but the token blob (the full text comes with one rollout)
LIST_COLUMNS = (
    "rollout_id, group_id, sample_idx, env, status, reason, error, step, prompt_text, system_prompt, "
    "completion_text, prompt_tokens, completion_tokens, total_tokens, num_turns, stop_reason, reward, "
    "advantage, sample_metrics, golden_answers, start_version, end_version, off_policy_steps, lane, "
    "server, dispatch_time, generation_end_time, finish_time, reward_time"
)
SORTS = {
    "group": "group_id, sample_idx",
    "reward": "reward",
    "advantage": "advantage",
    "length": "completion_tokens",
    "turns": "num_turns",
    "off_policy": "off_policy_steps",
    "id": "rollout_id",
}
STATUSES = ("kept", "discarded", "cancelled", "eval", "abandoned")


@dataclass(frozen=True)
class RolloutFilter:
    """What to list of one step; every field optional. ``text`` matches prompt or completion."""

    statuses: tuple[str, ...] = ("kept",)
    envs: tuple[str, ...] = ()
    stop_reasons: tuple[str, ...] = ()
    reward_min: float | None = None
    reward_max: float | None = None
    text: str = ""
    eval_name: str = ""

    def sql(self) -> tuple[str, list[Any]]:
        clauses = [f"status IN ({','.join('?' * len(self.statuses))})"]
        args: list[Any] = list(self.statuses)
        for column, values in (("env", self.envs), ("stop_reason", self.stop_reasons)):
            if values:
                clauses.append(f"{column} IN ({','.join('?' * len(values))})")
                args += values
        if self.reward_min is not None:
            clauses.append("reward >= ?")
            args.append(self.reward_min)
        if self.reward_max is not None:
            clauses.append("reward <= ?")
            args.append(self.reward_max)
        if self.text:
            pattern = "%" + self.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            clauses.append("(prompt_text LIKE ? ESCAPE '\\' OR completion_text LIKE ? ESCAPE '\\')")
            args += [pattern, pattern]
        if self.eval_name:
            clauses.append("env = ?")
            args.append(self.eval_name)
        return " AND ".join(clauses), args


def step_rollouts(
    reader: RunReader,
    step: int,
    where: RolloutFilter = RolloutFilter(),
    sort: str = "group",
    descending: bool = False,
    offset: int = 0,
    limit: int = 200,
) -> dict[str, Any]:
    """One page of a step's rollouts that pass ``where``, with the total that pass and the
    environments, stop reasons and statuses the step has (for the filter menus)."""
    clause, args = where.sql()
    order = SORTS[sort]
    if descending:
        order = ", ".join(f"{c.strip()} DESC" for c in order.split(","))
    rows = reader.rows(
        f"SELECT {LIST_COLUMNS} FROM rollouts WHERE step = ? AND {clause} "
        f"ORDER BY {order}, rollout_id LIMIT ? OFFSET ?",
        [step, *args, limit, offset],
    )
    for r in rows:
        _decode(r)
    total = reader.rows(f"SELECT COUNT(*) AS n FROM rollouts WHERE step = ? AND {clause}", [step, *args])
    facets = reader.rows(
        "SELECT env, stop_reason, status, COUNT(*) AS n FROM rollouts WHERE step = ? "
        "GROUP BY env, stop_reason, status",
        (step,),
    )
    return {
        "step": step,
        "total": total[0]["n"],
        "offset": offset,
        "rollouts": rows,
        "envs": sorted({f["env"] for f in facets}),
        "stop_reasons": sorted({f["stop_reason"] for f in facets}),
        "statuses": {s: sum(f["n"] for f in facets if f["status"] == s) for s in STATUSES},
    }


def rollout_detail(reader: RunReader, rollout_id: int) -> dict[str, Any] | None:
    """One rollout with its turns, each turn's tool calls and environment messages."""
    rows = reader.rows(
        f"SELECT {LIST_COLUMNS}, retokenized FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    )
    if not rows:
        return None
    out = _decode(rows[0])
    out["turns"] = reader.turns(rollout_id)
    for turn in out["turns"]:
        for call in turn["tool_calls"]:
            call["extra"] = json.loads(call["extra"])
            call["success"] = bool(call["success"])
    return out


def steps_with_rollouts(reader: RunReader, status: str = "kept") -> list[int]:
    """The steps that have rollouts of ``status``, found by seeking from one step to the next
    (an index on ``(status, step)`` or ``(step, status)`` makes each seek short)."""
    sql = """
        WITH RECURSIVE steps(step) AS (
            SELECT MIN(step) FROM rollouts WHERE status = ?
            UNION ALL
            SELECT (SELECT MIN(step) FROM rollouts WHERE status = ? AND step > steps.step)
            FROM steps WHERE steps.step IS NOT NULL)
        SELECT step FROM steps WHERE step IS NOT NULL"""
    return [r["step"] for r in reader.rows(sql, (status, status))]


def eval_names(reader: RunReader) -> dict[str, list[int]]:
    """Each eval's name with the steps it was reported at."""
    out: dict[str, list[int]] = {}
    for r in reader.rows("SELECT DISTINCT env, step FROM rollouts WHERE status = 'eval' ORDER BY env, step"):
        out.setdefault(r["env"], []).append(r["step"])
    return out


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    row["sample_metrics"] = json.loads(row["sample_metrics"])
    row["golden_answers"] = json.loads(row["golden_answers"])
    return row


def rollout_token_segments(reader: RunReader, rollout_id: int) -> dict[str, Any] | None:
    """A rollout's stored token ids cut into per-turn segments (None: no such rollout).

    The run store keeps ``completion_ids`` only (turn 0's prompt ids are not stored, just their
    count): turn 0's completion, then per later turn its new input tokens (env response and
    template glue) followed by its completion. Each turn's ``input_ids`` is None for turn 0; when
    the rollout was ``retokenized`` (or the counts do not add up) the whole sequence comes back as
    a single segment with ``split`` False."""
    rows = reader.rows(
        "SELECT prompt_tokens, retokenized, completion_ids FROM rollouts WHERE rollout_id = ?", (rollout_id,)
    )
    if not rows:
        return None
    row = rows[0]
    ids = tokens_from_blob(row["completion_ids"])
    turns = reader.rows(
        "SELECT turn_idx, prompt_tokens, completion_tokens FROM turns WHERE rollout_id = ? ORDER BY turn_idx",
        (rollout_id,),
    )
    segments: list[dict[str, Any]] = []
    pos = 0
    ok = not row["retokenized"] and bool(turns)
    for t in turns if ok else []:
        if t["turn_idx"] == 0:
            glue = None
        else:
            n = t["prompt_tokens"] - (row["prompt_tokens"] + pos)
            if n < 0:
                ok = False
                break
            glue = ids[pos : pos + n]
            pos += n
        comp = ids[pos : pos + t["completion_tokens"]]
        pos += t["completion_tokens"]
        segments.append({"turn_idx": t["turn_idx"], "input_ids": glue, "completion_ids": comp})
    if not ok or pos != len(ids):
        segments = [{"turn_idx": None, "input_ids": None, "completion_ids": ids}]
        ok = False
    return {"prompt_tokens": row["prompt_tokens"], "split": ok, "turns": segments}
