"""Rollout lifecycle spans and the in-flight snapshot, from the real orchestrator with fake servers."""

import asyncio

from orch_fakes import FakeClock, FakeServer, FakeTrainer, MemoryStore, ToyEnv, make_config, wait_until

from refractor.envs.tool_env import ToolEnvironment
from refractor.orchestrator import Orchestrator, OrchestratorSettings
from refractor.records import RewardResult, Sample

TOOL_CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return f"value of {key}"


class LookupEnv(ToolEnvironment):
    def __init__(self, **kw):
        super().__init__(tools=[lookup], max_turns=3, **kw)

    @property
    def name(self) -> str:
        return "lookup"

    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample(f"question {i}", "yes") for i in range(8)]
        return self._samples

    async def compute_reward(self, state, eos_token=""):
        return RewardResult(float("yes" in state.completion_text))


def call_then_answer(prompt, sampling):
    return "yes" if "[lookup]" in prompt else TOOL_CALL


def build(tok, cfg, env, server):
    store = MemoryStore()
    orch = Orchestrator(
        OrchestratorSettings.from_config(cfg), [env], [server], FakeTrainer(), store, tok, clock=FakeClock()
    )
    return orch, store


def spans_of(store, rollout_id):
    out = {}
    for e in store.events:
        if getattr(e, "component", None) == "rollout" and e.attrs["rollout_id"] == rollout_id:
            out.setdefault(e.name, []).append(e)
    return out


def test_every_generation_env_response_tool_call_and_reward_is_a_span(tok):
    cfg = make_config(env_names=("lookup",), number_of_steps=2, max_tokens=64, max_model_len=1024)
    server = FakeServer("s0", tok, answer=call_then_answer)
    orch, store = build(tok, cfg, LookupEnv(), server)
    asyncio.run(orch.run())
    kept = store.by_status("kept")
    assert len(kept) == 4
    for r in kept:
        spans = spans_of(store, r.rollout_id)
        gens, envs = spans["generation"], spans["env_response"]
        assert [e.attrs["turn"] for e in gens] == [0, 1] == [e.attrs["turn"] for e in envs]
        for e in gens:
            assert (e.attrs["server"], e.attrs["lane"], e.attrs["group_id"]) == ("s0", r.lane, r.group_id)
            assert e.attrs["sample"] == r.sample_idx and "outcome" not in e.attrs
        assert gens[0].attrs["completion_tokens"] == len(r.turns[0].completion_ids)
        assert gens[0].end <= envs[0].start <= envs[0].end <= gens[1].start <= gens[1].end <= envs[1].start
        (reward,) = spans["reward"]
        assert envs[1].end <= reward.start and reward.attrs["ok"] is True
        # the tool ran once, in turn 0, timed by the environment (its own wall clock)
        (tool,) = spans["tool_execution"]
        assert (tool.attrs["tool"], tool.attrs["turn"], tool.attrs["tool_call"], tool.attrs["success"]) == (
            "lookup",
            0,
            0,
            True,
        )
        assert tool.start <= tool.end
        assert r.turns[0].tool_calls[0].raw["started_at"] == tool.start


def test_the_inflight_snapshot_lists_running_generations_and_a_cancelled_one_is_closed(tok):
    cfg = make_config(number_of_steps=1, max_concurrent_prompts_per_server=2)
    server = FakeServer("s0", tok, manual=True)
    orch, store = build(tok, cfg, ToyEnv(), server)

    async def main():
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: len(server.pending) == 4, "two groups dispatched")
        now = orch.rollout_events.inflight()
        assert now["count"] == 4 and {s["name"] for s in now["spans"]} == {"generation"}
        assert sorted(s["lane"] for s in now["spans"]) == [0, 1, 2, 3]
        assert [s["start"] for s in now["spans"]] == sorted(s["start"] for s in now["spans"])
        # the snapshot reaches the run store, where readers in other processes see it
        await wait_until(lambda: store.meta.get("inflight", {}).get("count") == 4, "the snapshot", 10.0)
        first = server.pending[0].prompt_text
        for req in [r for r in server.pending if r.prompt_text == first]:
            server.finish(req, "yes")
        await task  # one step: the other group is cancelled when the run ends

    asyncio.run(main())
    cancelled = store.by_status("cancelled")  # the second group, and any dispatched after the first
    assert len(cancelled) >= 2
    for r in cancelled:
        (gen,) = spans_of(store, r.rollout_id)["generation"]
        assert gen.attrs["outcome"] == "cancelled"
    assert store.meta["inflight"]["count"] == 0 and not orch.rollout_events.inflight()["spans"]


class IdServer(FakeServer):
    """Answers without latency, naming each request as a vLLM server does."""

    async def generate(self, token_ids, sampling, *, priority=0):
        request_id = f"generate-tokens-{len(self.calls) + 1}"
        result = await super().generate(token_ids, sampling, priority=priority)
        result.server_request_id = request_id
        return result


class LateLatency:
    """A latency source (vLLM's trace spans) that knows one request, and tells it only after 0.3 s."""

    def __init__(self, request_id: str, latency: dict[str, float]) -> None:
        self.known = {request_id: latency}
        self.asked: list[str] = []

    async def take(self, request_id, timeout_s):
        self.asked.append(request_id)
        if request_id not in self.known:
            await asyncio.sleep(timeout_s)
            return None
        await asyncio.sleep(0.3)
        return self.known[request_id]


def test_a_generation_span_gets_late_latency_without_holding_up_its_rollout(tok):
    cfg = make_config(number_of_steps=1)
    latency = {"ttft": 0.5, "e2e_latency": 1.5}
    source = LateLatency("generate-tokens-1", latency)
    store = MemoryStore()
    orch = Orchestrator(
        OrchestratorSettings.from_config(cfg),
        [ToyEnv()],
        [IdServer("s0", tok)],
        FakeTrainer(),
        store,
        tok,
        clock=FakeClock(),
        latency=source,
    )
    asyncio.run(orch.run())
    gens = [e for e in store.events if getattr(e, "component", None) == "rollout" and e.name == "generation"]
    finished = [g for g in gens if "outcome" not in g.attrs]
    assert finished and sorted(source.asked) == sorted(g.attrs["request_id"] for g in finished)
    (known,) = [g for g in gens if g.attrs["request_id"] == "generate-tokens-1"]
    assert {k: known.attrs[k] for k in latency} == latency
    assert all("ttft" not in g.attrs for g in gens if g is not known)  # never arrived: written without
    # the rollout went on to its reward while its generation span waited for the latency
    reward = next(
        e for e in store.events if e.name == "reward" and e.attrs["rollout_id"] == known.attrs["rollout_id"]
    )
    assert store.events.index(reward) < store.events.index(known)
