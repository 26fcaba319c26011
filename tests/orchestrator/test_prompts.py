"""Prompt stream: seeded determinism, weights, epochs, and resume equality (prefetch included)."""

import asyncio
import json
from collections import Counter

import pytest

from refractor.orchestrator.prompts import PromptPrefetcher, PromptStream
from refractor.records import PromptRef

SIZES = {"math": 7, "code": 3}


def draw(stream, n):
    return [stream.next() for _ in range(n)]


def test_same_seed_same_stream_other_seed_differs():
    assert draw(PromptStream(SIZES, {"math": 2.0}, seed=1), 50) == draw(
        PromptStream(SIZES, {"math": 2.0}, seed=1), 50
    )
    assert draw(PromptStream(SIZES, seed=1), 50) != draw(PromptStream(SIZES, seed=2), 50)


def test_weights_and_epochs():
    refs = draw(PromptStream(SIZES, {"math": 3.0, "code": 1.0}, seed=0), 4000)
    share = Counter(r.env_name for r in refs)["math"] / len(refs)
    assert share == pytest.approx(0.75, abs=0.03)
    # within each epoch of an environment, every index appears exactly once
    code = [r.index for r in refs if r.env_name == "code"]
    for e in range(len(code) // 3):
        assert sorted(code[3 * e : 3 * e + 3]) == [0, 1, 2]
    single = draw(PromptStream({"only": 4}, seed=3), 8)
    assert sorted(r.index for r in single[:4]) == [0, 1, 2, 3]


def test_resume_equality_through_json():
    full = draw(PromptStream(SIZES, {"code": 2.0}, seed=5), 60)
    s = PromptStream(SIZES, {"code": 2.0}, seed=5)
    first = draw(s, 25)
    state = json.loads(json.dumps(s.state_dict()))
    resumed = PromptStream(SIZES, {"code": 2.0}, seed=999)
    resumed.load_state_dict(state)
    assert first + draw(resumed, 35) == full


def test_state_from_other_dataset_is_refused():
    s = PromptStream(SIZES)
    with pytest.raises(ValueError, match="dataset sizes"):
        PromptStream({"math": 8, "code": 3}).load_state_dict(s.state_dict())


def test_bad_inputs_name_the_culprit():
    with pytest.raises(ValueError, match=r"\['code'\].*empty dataset"):
        PromptStream({"math": 2, "code": 0})
    with pytest.raises(ValueError, match="unknown environment"):
        PromptStream(SIZES, {"chess": 1.0})


def test_prefetched_prompts_survive_resume():
    def prepare(ref: PromptRef) -> str:
        return f"{ref.env_name}:{ref.index}"

    async def consume(pf, n):
        return [await pf.take() for _ in range(n)]

    async def main():
        reference = PromptPrefetcher(PromptStream(SIZES, seed=11), prepare, buffer_size=4)
        expected = await consume(reference, 30)
        assert [ref.ordinal for ref, _ in expected] == list(range(30))

        pf = PromptPrefetcher(PromptStream(SIZES, seed=11), prepare, buffer_size=4)
        got = await consume(pf, 12)
        assert len(pf) == 4  # four prompts prepared but not taken
        in_flight = [got[10][0]]  # e.g. a group that was running at checkpoint time
        state = json.loads(json.dumps(pf.state_dict(in_flight=in_flight)))
        pf.close()

        resumed = PromptPrefetcher(PromptStream(SIZES, seed=0), prepare, buffer_size=4)
        resumed.load_state_dict(state)
        assert resumed.lowest_unconsumed_ordinal() == 10
        after = await consume(resumed, 19)
        resumed.close()
        # the in-flight prompt is replayed first, with its ordinal; then exactly the uninterrupted sequence
        assert after[0] == expected[10]
        assert after[1:] == expected[12:]
        reference.close()

    asyncio.run(main())


def test_replay_is_served_in_stream_order_and_keeps_ordinals():
    s = PromptStream(SIZES, seed=4)
    drawn = draw(s, 10)
    # saved out of order (buffered batch, bucket, in flight, ...), replayed in stream order
    state = json.loads(json.dumps(s.state_dict(unconsumed=[drawn[7], drawn[2], drawn[5]])))
    resumed = PromptStream(SIZES, seed=4)
    resumed.load_state_dict(state)
    assert resumed.lowest_unconsumed_ordinal() == 2
    assert draw(resumed, 3) == [drawn[2], drawn[5], drawn[7]]
    assert [r.ordinal for r in draw(resumed, 2)] == [10, 11]  # fresh draws continue the count


def test_replay_entries_without_ordinal_get_fresh_ones():
    s = PromptStream(SIZES, seed=4)
    draw(s, 3)
    state = s.state_dict()
    state["replay"] = [["math", 1], ["code", 2]]  # a checkpoint written before ordinals existed
    resumed = PromptStream(SIZES, seed=4)
    resumed.load_state_dict(state)
    assert draw(resumed, 3) == [
        PromptRef("math", 1, 3),
        PromptRef("code", 2, 4),
        PromptRef(*_fresh(SIZES, 4, 3), 5),
    ]


def _fresh(sizes, seed, n_before):
    """(env, index) of the stream's draw number ``n_before`` (what a fresh stream yields there)."""
    ref = draw(PromptStream(sizes, seed=seed), n_before + 1)[-1]
    return ref.env_name, ref.index


def test_put_back_serves_returned_prompts_first_in_stream_order():
    async def main():
        pf = PromptPrefetcher(PromptStream(SIZES, seed=2), lambda ref: ref.index, buffer_size=3)
        taken = [(await pf.take())[0] for _ in range(6)]
        pf.put_back([taken[5], taken[3]])  # e.g. groups past a batch's cut
        again = [(await pf.take())[0] for _ in range(3)]
        assert again[:2] == [taken[3], taken[5]]
        assert again[2].ordinal == 6 and pf.lowest_unconsumed_ordinal() == 7
        pf.close()

    asyncio.run(main())
