"""Chunked log-prob + entropy (forward + backward) vs the naive full-logits computation.

Default shape: 16,384 packed tokens, hidden 896, vocabulary 151,936 (Qwen2.5-0.5B), bf16 on CUDA.
Both variants compute the sampled-token log-probs and the entropy of the temperature-scaled
distribution, and back-propagate a loss that uses both (the entropy-bonus case), plus the common
case where only the log-probs get a gradient (entropy as a metric, computed without grad).
Prints peak memory above the inputs, time per iteration, both ratios, and the max deviation of
the chunked results from the naive ones.

    PYTHONPATH=src python bench/bench_logprobs.py                       # GPU defaults
    PYTHONPATH=src python bench/bench_logprobs.py --device cpu --tokens 512 --vocab 4096 --hidden 64
"""

from __future__ import annotations

import argparse
import time

import torch

from refractor.algorithms.logprobs import chunked_logprobs_entropy


def naive(hidden, weight, targets, temperature, entropy_grad: bool):
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    if entropy_grad:
        ent = -(logp.exp() * logp).sum(-1)
    else:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def chunked(hidden, weight, targets, temperature, entropy_grad: bool, chunk_size: int):
    lp, ent = chunked_logprobs_entropy(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk_size
    )
    return lp, ent if entropy_grad else ent.detach()


def run(fn, h0, w0, targets, g_lp, g_ent, device, iters, warmup):
    """Returns (seconds per iteration, peak bytes above the inputs, outputs and grads of the last run)."""

    def once():
        h = h0.detach().requires_grad_()
        w = w0.detach().requires_grad_()
        lp, ent = fn(h, w, targets)
        loss = (lp * g_lp).sum()
        if ent.requires_grad:
            loss = loss + (ent * g_ent).sum()
        loss.backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    for _ in range(warmup):
        once()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = once()
        del out
    sync()
    dt = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return dt, peak, once()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk-sizes", type=str, default="1024,4096")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = args.device
    torch.manual_seed(0)
    h0 = (torch.randn(args.tokens, args.hidden, device=dev) * 0.5).to(dtype)
    w0 = (torch.randn(args.vocab, args.hidden, device=dev) * 0.05).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    g_lp = torch.randn(args.tokens, device=dev)
    g_ent = torch.randn(args.tokens, device=dev) * 0.01
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(
        f"device={name} tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} dtype={args.dtype} "
        f"T={args.temperature} torch={torch.__version__}"
    )
    for entropy_grad in (True, False):
        label = "logprob+entropy grads" if entropy_grad else "logprob grad, entropy metric"
        try:
            t_n, m_n, ref = run(
                lambda h, w, y, eg=entropy_grad: naive(h, w, y, args.temperature, eg),
                h0,
                w0,
                targets,
                g_lp,
                g_ent,
                dev,
                args.iters,
                args.warmup,
            )
        except torch.OutOfMemoryError:
            print(f"[{label}] naive           : out of memory")
            torch.cuda.empty_cache()
            continue
        print(f"[{label}] naive           : {t_n * 1e3:8.1f} ms  peak {m_n / 2**30:6.2f} GiB")
        for cs in (int(c) for c in args.chunk_sizes.split(",")):
            t_c, m_c, out = run(
                lambda h, w, y, eg=entropy_grad, cs=cs: chunked(h, w, y, args.temperature, eg, cs),
                h0,
                w0,
                targets,
                g_lp,
                g_ent,
                dev,
                args.iters,
                args.warmup,
            )
            dev_lp = (out[0] - ref[0]).abs().max().item()
            dev_ent = (out[1] - ref[1]).abs().max().item()
            dev_gh = ((out[2].float() - ref[2].float()).abs().max() / ref[2].float().abs().max()).item()
            dev_gw = ((out[3].float() - ref[3].float()).abs().max() / ref[3].float().abs().max()).item()
            mem_ratio = m_n / m_c if m_c else float("nan")
            print(
                f"[{label}] chunked cs={cs:<5}: {t_c * 1e3:8.1f} ms  peak {m_c / 2**30:6.2f} GiB  "
                f"memory {mem_ratio:5.1f}x less, speed {t_n / t_c:4.2f}x  "
                f"| max|dlp| {dev_lp:.1e} max|dH| {dev_ent:.1e} "
                f"rel dgrad_h {dev_gh:.1e} rel dgrad_w {dev_gw:.1e}"
            )
            del out
        del ref
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
