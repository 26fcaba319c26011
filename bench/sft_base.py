"""Stage 1 of the RL demonstration: a small base model trained from scratch with next-token SFT.

No pretrained weights can be downloaded on the machines this project runs on, so the base model for
the "RL improves a real task" benchmark is made here: a byte-level BPE tokenizer trained on the
task's text, a Qwen2-shaped model built with refractor's shared model definition, and plain SFT on
procedurally generated countdown problems with worked solutions, rendered exactly as the countdown
environment renders its prompts (system prompt, instruction, chat template). The result is a normal
HF checkpoint directory (config, safetensors, tokenizer with its chat template, generation config)
that ``refractor train`` and ``AutoModelForCausalLM`` load as they are.

    python bench/sft_base.py --out runs/countdown-base --size small --steps 3000      # one GPU
    python bench/sft_base.py --out /tmp/toy --size toy --steps 40 --device cpu        # a toy run

The SFT problems come from a seed of their own; held-out accuracy (``--eval N``) is measured with the
native engine (greedy) on the environment's procedural problems of seed 1, the held-out problems the
RL config evaluates on (it trains on seed 0), scored by the environment's equation reward. Choose
``--steps`` so that it lands clearly between 0 and the ceiling: RL needs room to improve.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import time
from pathlib import Path

import torch

SFT_SEED = 1234  # the RL run trains on the environment's procedural problems of seed 0
EVAL_SEED = 1  # and evaluates on those of seed 1 (configs/examples/countdown_from_scratch.yaml)
SIZES = {  # Qwen2 shapes: hidden, layers, heads, kv heads, intermediate
    "toy": (64, 2, 2, 1, 128),
    "small": (384, 8, 6, 2, 1024),
    "medium": (512, 12, 8, 2, 1536),
}


def _steps(expression: str) -> tuple[list[str], int]:
    """``(57 + 3) * 2`` -> (["57 + 3 = 60", "60 * 2 = 120"], 120): the expression worked left to right."""
    steps = []

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant):
            return int(node.value)
        left, right = walk(node.left), walk(node.right)
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        value = {"+": left + right, "-": left - right, "*": left * right, "/": left // right}[op]
        steps.append(f"{left} {op} {right} = {value}")
        return value

    value = walk(ast.parse(expression, mode="eval").body)
    return steps, value


def worked_solution(expression: str, misses: list[str] | None = None) -> str:
    """The solution's arithmetic in the think tags, then its expression as the answer:
    ``<think> 57 + 3 = 60, 60 * 2 = 120 </think> <answer> (57 + 3) * 2 </answer>``.

    With ``misses`` (expressions over the same numbers that do not reach the target; possibly none),
    the think tags first try each of them and reject it, then try the solution and accept it (a
    searched solution):
    ``<think> 57 * 3 = 171, 171 - 2 = 169 no; 57 + 3 = 60, 60 * 2 = 120 yes </think> <answer> ...``.
    """
    if misses is None:
        return f"<think> {', '.join(_steps(expression)[0])} </think> <answer> {expression} </answer>"
    tries = [", ".join(_steps(e)[0]) + " no" for e in misses] + [", ".join(_steps(expression)[0]) + " yes"]
    return f"<think> {'; '.join(tries)} </think> <answer> {expression} </answer>"


def missed_expression(nums: list[int], target: int, rng: random.Random) -> str | None:
    """A random left-to-right expression using every number once whose value is not ``target``
    (every intermediate value a positive integer), or None after a few tries."""
    for _ in range(20):
        order = nums[:]
        rng.shuffle(order)
        value, expr = order[0], str(order[0])
        for n in order[1:]:
            op = rng.choice("+-*/")
            if (op == "-" and value - n <= 0) or (op == "/" and value % n != 0):
                op = "+"
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            expr = f"({expr} {op} {n})"
        if value != target:
            return expr[1:-1]
    return None


def sft_examples(
    count: int, seed: int = SFT_SEED, shape: dict | None = None, attempts: int = 0
) -> list[tuple[list[dict], str]]:
    """(prompt messages, completion) pairs: the environment's prompt of a fresh problem and its worked
    solution, after 0..``attempts`` rejected tries when ``attempts`` > 0. ``shape``: the procedural
    problems' difficulty (the environment's ``procedural_*`` keyword arguments)."""
    from refractor.envs.builtin.countdown import CountdownEnvironment, generate_problem
    from refractor.records import Sample

    env = CountdownEnvironment(dataset_name="procedural", **(shape or {}))
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        nums, target, expression = generate_problem(rng, **env.procedural_shape)
        sample = env.sample_from_row({"nums": nums, "target": target})
        misses = [missed_expression(nums, target, rng) for _ in range(rng.randint(0, attempts))]
        out.append(
            (
                env.get_initial_prompt(Sample(sample.prompt, sample.answer)),
                worked_solution(expression, [m for m in misses if m is not None] if attempts else None),
            )
        )
    return out


def build_tokenizer(texts: list[str], vocab_size: int, split_digits: bool = True):
    """Byte-level BPE trained on ``texts``, ChatML template, ``<|im_end|>`` as EOS (the test models'
    tokenizer recipe on this corpus). Digits split by default: with numbers as BPE merges, "19" in
    the prompt and " 19" in the solution are unrelated tokens, and bases trained that way scored 0%
    on held-out problems (bench/RESULTS.md)."""
    from refractor.testing.tiny_models import build_tokenizer as build

    return build(texts, vocab_size, split_digits=split_digits)


def encode(examples, tokenizer) -> list[tuple[list[int], int]]:
    """(token ids, prompt length): prompt rendered with the chat template, completion + EOS after it."""
    out = []
    for messages, completion in examples:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        out.append((prompt_ids + completion_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return out


def hf_config(size: str, vocab_size: int, tokenizer, max_len: int):
    from transformers import AutoConfig

    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    return AutoConfig.for_model(
        "qwen2",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        vocab_size=vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        torch_dtype="float32",
    )


def batches(encoded, tokens_per_batch: int, rng: random.Random):
    """Endless packed rows of about ``tokens_per_batch`` tokens: (ids, positions, document ids, loss mask)."""
    while True:
        order = list(range(len(encoded)))
        rng.shuffle(order)
        row: list[tuple[list[int], int]] = []
        size = 0
        for i in order:
            ids, prompt_len = encoded[i]
            if row and size + len(ids) > tokens_per_batch:
                yield pack(row)
                row, size = [], 0
            row.append((ids, prompt_len))
            size += len(ids)


def pack(row: list[tuple[list[int], int]]):
    """One packed row: (ids, positions, document ids, loss mask, cu_seqlens), and its longest sample,
    all made on the host so that a step does not wait for the GPU to tell it the row's layout."""
    ids, positions, documents, mask, cu = [], [], [], [], [0]
    for d, (tokens, prompt_len) in enumerate(row):
        ids += tokens
        positions += range(len(tokens))
        documents += [d] * len(tokens)
        mask += [0] * prompt_len + [1] * (len(tokens) - prompt_len)  # loss on the completion and EOS
        cu.append(cu[-1] + len(tokens))
    tensors = (torch.tensor(ids), torch.tensor(positions), torch.tensor(documents), torch.tensor(mask))
    return (*tensors, torch.tensor(cu, dtype=torch.int32)), max(len(t) for t, _ in row)


def train(args) -> dict:
    from refractor.models import PackedAttention, build_model

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    examples = sft_examples(args.examples, shape=args.shape, attempts=args.attempts)
    texts = [json.dumps(m) + c for m, c in examples[:2000]]
    tokenizer = build_tokenizer(texts, args.vocab_size, split_digits=getattr(args, "split_digits", True))
    encoded = encode(examples, tokenizer)
    max_len = max(len(ids) for ids, _ in encoded)
    vocab = -(-len(tokenizer) // 64) * 64
    config = hf_config(args.size, vocab, tokenizer, max(512, 2 ** math.ceil(math.log2(max_len + 64))))
    model = build_model(config.to_dict(), dtype=torch.float32, device=device)
    model.init_weights()
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95), fused=True
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    stream = batches(encoded, args.tokens_per_batch, random.Random(args.seed))
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    losses = []
    accuracies: dict[int, float] = {}
    started = time.perf_counter()
    for step in range(args.steps):
        tensors, longest = next(stream)
        ids, positions, documents, mask, cu = (t.to(device, non_blocking=True) for t in tensors)
        attention = PackedAttention(document_ids=documents, cu_seqlens=cu, max_seqlen=longest)
        with autocast:
            hidden = model(ids, positions, attention=attention)
        logits = model.compute_logits(hidden[:-1].float())
        targets = ids[1:]
        weights = mask[1:].float()
        loss = (
            torch.nn.functional.cross_entropy(logits, targets, reduction="none") * weights
        ).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())  # read back only when printed: a read every step stalls the GPU queue
        if step + 1 in args.eval_at and step + 1 < args.steps:  # the final weights are scored by main()
            snapshot = Path(args.out) / f"step{step + 1}"
            save(model, config, tokenizer, snapshot)
            accuracy = held_out_accuracy(snapshot, args.eval, args.device, args.max_tokens, args.shape)
            accuracies[step + 1] = accuracy
            print(
                f"step {step + 1}: held-out accuracy (greedy, {args.eval} problems) {accuracy:.3f}",
                flush=True,
            )
        if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
            print(
                f"step {step}/{args.steps} loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    save(model, config, tokenizer, Path(args.out))
    return {
        "losses": torch.stack(losses).tolist(),
        "train_s": time.perf_counter() - started,
        "params": sum(p.numel() for p in model.parameters()),
        "accuracy_at_step": accuracies,
    }


def save(model, config, tokenizer, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)


def held_out_accuracy(
    model_dir: str | Path,
    count: int,
    device: str = "cpu",
    max_tokens: int = 96,
    shape: dict | None = None,
    temperature: float = 0.0,
    samples: int = 1,
) -> float:
    """Greedy accuracy (equation reward) on the first ``count`` held-out procedural problems of the
    difficulty ``shape`` (the environment's ``procedural_*`` keyword arguments). With a temperature,
    the mean over ``samples`` seeded samples per problem: pass@1 at that temperature."""
    import asyncio

    from transformers import AutoTokenizer

    from refractor.envs.builtin.countdown import CountdownEnvironment
    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

    env = CountdownEnvironment(dataset_name="procedural", seed=EVAL_SEED, **(shape or {}))
    problems = env.load_dataset(count)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer(env.render_prompt(env.get_initial_prompt(s), tokenizer), add_special_tokens=False)[
            "input_ids"
        ]
        for s in problems
    ]
    config = EngineConfig(
        max_model_len=max(len(p) for p in prompts) + max_tokens, kv_cache_memory_gb=0.5, device=device
    )
    engine = LLMEngine.from_pretrained(model_dir, config)
    n = 1 if temperature == 0 else samples
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=0)
    outputs = engine.generate(prompts, params)
    correct = 0.0
    for problem, out in zip(problems, outputs, strict=True):
        for completion in out.outputs:
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            reward, _ = env._equation_reward(text, problem)
            correct += reward
    asyncio.run(env.close())
    return correct / (len(problems) * n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the HF checkpoint directory to write")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--examples", type=int, default=50000, help="distinct SFT problems")
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eval", type=int, default=200, help="held-out problems to score after training (0: none)"
    )
    ap.add_argument(
        "--eval-at",
        default="",
        help="comma list of steps at which to save a snapshot (OUT/stepN) and score it (--eval problems)",
    )
    ap.add_argument("--numbers", default="3,4", help="MIN,MAX numbers per problem")
    ap.add_argument("--max-number", type=int, default=99, help="largest number of a problem")
    ap.add_argument("--max-target", type=int, default=999, help="largest target")
    ap.add_argument(
        "--attempts", type=int, default=0, help="up to this many rejected tries before each solution (search)"
    )
    ap.add_argument("--max-tokens", type=int, default=96, help="completion tokens at evaluation")
    ap.add_argument(
        "--bpe-digits", dest="split_digits", action="store_false", help="let BPE merge digits into numbers"
    )
    args = ap.parse_args()
    low, high = (int(n) for n in args.numbers.split(","))
    args.shape = {
        "procedural_min_numbers": low,
        "procedural_max_numbers": high,
        "procedural_max_number": args.max_number,
        "procedural_max_target": args.max_target,
    }
    args.eval_at = {int(s) for s in args.eval_at.split(",") if s}
    if args.eval_at and not args.eval:
        ap.error("--eval-at needs --eval > 0")
    result = train(args)
    print(
        f"trained {result['params'] / 1e6:.1f}M parameters in {result['train_s']:.0f} s; "
        f"final loss {result['losses'][-1]:.4f}"
    )
    if args.eval:
        accuracy = held_out_accuracy(args.out, args.eval, args.device, args.max_tokens, args.shape)
        result["accuracy_at_step"][args.steps] = accuracy
        print(f"held-out accuracy (greedy, {args.eval} problems): {accuracy:.3f}")
    summary = {k: v for k, v in result.items() if k != "losses"} | {
        "final_loss": result["losses"][-1],
        "args": {k: v for k, v in vars(args).items() if k != "eval_at"},
    }
    (Path(args.out) / "sft_summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
