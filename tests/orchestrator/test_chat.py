"""Token-exact multi-turn prompts: interleaving equals a full re-render for an append-only template;
a template that rewrites history falls back to re-rendering and marks the rollout."""

import copy

from refractor.orchestrator.chat import ChatTokens
from refractor.records import Rollout, Turn, append_turn_tokens, to_train_samples


def test_interleaved_prompt_equals_full_render_with_or_without_eos(tok):
    chat = ChatTokens(tok)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = chat.render(first)
    env = [{"role": "user", "content": "Are you sure?", "turn_type": "feedback"}]
    expected = chat.render([*first, {"role": "assistant", "content": "It is 4."}, *env])
    for completion in (chat.encode("It is 4.") + [tok.eos_token_id], chat.encode("It is 4.")):
        assert chat.next_turn_ids(prompt + completion, completion, env) == expected


def test_sampled_tokens_are_kept_even_when_text_would_retokenize_differently(tok):
    chat = ChatTokens(tok)
    prompt = chat.render([{"role": "user", "content": "hi"}])
    odd = [int(t) for t in chat.encode("ab")][::-1] + [
        tok.eos_token_id
    ]  # a sequence no encoder would produce
    nxt = chat.next_turn_ids(prompt + odd, odd, [{"role": "user", "content": "more"}])
    assert nxt[: len(prompt) + len(odd)] == prompt + odd


def test_rollout_layout_and_train_sample_alignment():
    r = Rollout(0, 0, 0, "env", advantage=0.5)
    t0 = Turn(0, [1, 2], [3, 4], [-0.1, -0.2])
    t1 = Turn(1, [1, 2, 3, 4, 7, 8], [5], [-0.3])
    for t in (t0, t1):
        r.turns.append(t)
        append_turn_tokens(r, t)
    [s] = to_train_samples(r)
    assert s.input_ids == [1, 2, 3, 4, 7, 8, 5]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert s.rollout_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.advantage == 0.5 and not r.retokenized


def test_history_rewriting_template_falls_back_and_trains_per_turn(tok):
    rewriting = copy.deepcopy(tok)
    # renders the number of messages first: every new message changes the beginning (not append-only)
    rewriting.chat_template = "{{ messages|length }}\n" + tok.chat_template
    chat = ChatTokens(rewriting)
    first = [{"role": "user", "content": "hi"}]
    prompt = chat.render(first)
    completion = chat.encode("yo") + [tok.eos_token_id]
    env = [{"role": "user", "content": "again"}]
    assert chat.next_turn_ids(prompt + completion, completion, env) is None
    second_prompt = chat.render([*first, {"role": "assistant", "content": "yo"}, *env])
    r = Rollout(0, 0, 0, "env", advantage=1.0)
    for t in (
        Turn(0, prompt, completion, [-0.1] * len(completion)),
        Turn(1, second_prompt, [5, 6], [-0.2, -0.3]),
    ):
        r.turns.append(t)
        append_turn_tokens(r, t)
    assert r.retokenized
    samples = to_train_samples(r)
    assert [s.input_ids for s in samples] == [prompt + completion, second_prompt + [5, 6]]
    assert samples[1].loss_mask == [0] * len(second_prompt) + [1, 1]
