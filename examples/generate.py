"""Greedy generation with context parallelism over a sharded KV cache, checked
token for token against one process.

    torchrun --standalone --nproc-per-node 4 examples/generate.py                 # CPU, gloo
    torchrun --standalone --nproc-per-node 4 examples/generate.py --prompt-len 16384

Three phases, on the tiny Llama of examples/tiny_llama.py:
1. prefill of a long prompt of P tokens, dealt over the ranks in contiguous
   chunks: ring attention with k/v travelling (``ring_pass="kv"``);
2. a follow-up chunk of T new tokens (the next turn of a conversation),
   dealt round-robin, attending the persistent cache of P + T keys:
   ``ring_pass="auto"``, which picks pass-Q (queries travel, the cache stays)
   when T is small against P + T;
3. greedy decode of ``--new-tokens`` tokens: every rank runs the new token,
   one rank caches it (round-robin), and ``cplib.decode_sdpa`` attends it to
   the sharded cache with one all-gather per layer.

Every rank holds about (P + T + new) / N cached tokens (``cplib.ShardedKVCache``).
Rank 0 then generates the same way in one process (a plain KV cache and
``F.scaled_dot_product_attention``) and prints the verdict (PASS when the
token ids are identical), the prefill time, the time to first token after
the follow-up chunk and the decode tokens/s of both, and exits non-zero on
FAIL.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cplib  # noqa: E402
from tiny_llama import TinyLlama, rotary  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=4096, help="P, the prompt")
    p.add_argument("--chunk-len", type=int, default=64, help="T, the follow-up chunk")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="log the ring_pass choice")
    return p.parse_args()


# ------------------------------------------------------------------ the model, layer by layer

def _qkv(block, x, positions):
    a = block.attn
    b, s, _ = x.shape
    h = block.attn_norm(x)
    q = a.wq(h).view(b, s, a.heads, a.head_dim).transpose(1, 2)
    k, v = a.wkv(h).view(b, s, 2, a.kv_heads, a.head_dim).permute(2, 0, 3, 1, 4)
    pos = positions.view(1, -1).expand(b, -1)
    return rotary(q, pos), rotary(k, pos), v


def _finish(block, x, attn):
    b, s, _ = x.shape
    x = x + block.attn.wo(attn.transpose(1, 2).reshape(b, s, -1))
    gate, up = block.gate_up(block.mlp_norm(x)).chunk(2, dim=-1)
    return x + block.down(F.silu(gate) * up)


def forward(model, ids, positions, attend):
    """Logits of ``ids`` (1, S) at ``positions`` (S); ``attend(layer, q, k, v)``
    caches the new k/v and returns the attention output (1, H, S, D)."""
    x = model.embed(ids)
    for layer, block in enumerate(model.blocks):
        q, k, v = _qkv(block, x, positions)
        x = _finish(block, x, attend(layer, q, k, v))
    return model.head(model.norm(x))


# ------------------------------------------------------------------ context parallel

def generate_cp(model, prompt, chunk, new_tokens, group):
    """Token ids and timings of the three phases under context parallelism."""
    cache = cplib.ShardedKVCache(group, len(model.blocks))

    def ring(ids, ring_pass):
        start = cache.seq_len
        mine = cache.deal(ids.numel(), contiguous=ring_pass == "kv")
        pos = start + mine  # global positions of our new rows

        def attend(layer, q, k, v):
            k_all, v_all = cache.update(layer, k, v)
            out, _ = cplib.ring_sdpa(q, k_all, v_all, group, is_causal=True, q_positions=pos,
                                     kv_positions=cache.positions, ring_pass=ring_pass)
            return out
        return forward(model, ids[mine].view(1, -1), pos, attend), pos

    def owner_token(logits, pos, last):
        """The greedy token after global position ``last``, from the rank holding it."""
        tok = torch.zeros(1, dtype=torch.long)
        hit = (pos == last).nonzero()
        if hit.numel():
            tok[0] = logits[0, hit[0, 0]].argmax() + 1
        dist.all_reduce(tok, group=group)
        return int(tok[0]) - 1

    times = {}
    dist.barrier(group)
    t0 = time.perf_counter()
    ring(prompt, "kv")
    dist.barrier(group)
    times["prefill"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, pos = ring(chunk, "auto")
    token = owner_token(logits, pos, cache.seq_len - 1)
    times["ttft"] = time.perf_counter() - t0
    tokens = [token]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        p = cache.seq_len
        mine = cache.deal(1)
        qpos = torch.tensor([p])

        def attend(layer, q, k, v):
            k_all, v_all = cache.update(layer, k[:, :, mine], v[:, :, mine])
            out, _ = cplib.decode_sdpa(q, k_all, v_all, group, q_positions=qpos,
                                       kv_positions=cache.positions)
            return out
        logits = forward(model, torch.tensor([[tokens[-1]]]), qpos, attend)
        tokens.append(int(logits[0, -1].argmax()))  # the same on every rank
    dist.barrier(group)
    times["decode"] = time.perf_counter() - t0
    times["cached_rows"] = len(cache)
    times["cache_bytes"] = cache.memory_bytes()
    return tokens, times


# ------------------------------------------------------------------ one process

def generate_local(model, prompt, chunk, new_tokens):
    ks = [None] * len(model.blocks)
    vs = [None] * len(model.blocks)
    state = {"len": 0}

    def run(ids):
        p0 = state["len"]
        pos = torch.arange(p0, p0 + ids.numel())
        kv_pos = torch.arange(0, p0 + ids.numel())
        mask = kv_pos.view(1, -1) <= pos.view(-1, 1)

        def attend(layer, q, k, v):
            ks[layer] = k if ks[layer] is None else torch.cat([ks[layer], k], 2)
            vs[layer] = v if vs[layer] is None else torch.cat([vs[layer], v], 2)
            return F.scaled_dot_product_attention(q, ks[layer], vs[layer], attn_mask=mask,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        logits = forward(model, ids.view(1, -1), pos, attend)
        state["len"] += ids.numel()
        return logits

    times = {}
    t0 = time.perf_counter()
    run(prompt)
    times["prefill"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = [int(run(chunk)[0, -1].argmax())]
    times["ttft"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tokens.append(int(run(torch.tensor([tokens[-1]]))[0, -1].argmax()))
    times["decode"] = time.perf_counter() - t0
    return tokens, times


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format=f"rank {rank}: %(message)s")
        logging.getLogger("cplib").setLevel(logging.DEBUG)
    torch.manual_seed(args.seed)
    model = TinyLlama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads).eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=g)
    chunk = torch.randint(0, args.vocab, (args.chunk_len,), generator=g)
    total = args.prompt_len + args.chunk_len
    choice = cplib.ring_pass_auto(args.chunk_len, total, args.heads, args.kv_heads,
                                  args.dim // args.heads)
    with torch.no_grad():
        tokens, cp = generate_cp(model, prompt, chunk, args.new_tokens, group)
    rows = torch.tensor([cp["cached_rows"], cp["cache_bytes"]])
    all_rows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows)
    ok = torch.tensor([1])
    if rank == 0:
        with torch.no_grad():
            ref, ref_times = generate_local(model, prompt, chunk, args.new_tokens)
        ok[0] = int(tokens == ref)
    dist.broadcast(ok, 0)
    if rank == 0:
        n = args.new_tokens - 1
        print(f"world {world}, prompt P={args.prompt_len}, follow-up T={args.chunk_len} "
              f"(ring_pass auto -> {choice!r}), {args.new_tokens} new tokens")
        print("cached rows per rank: " + ", ".join(str(int(r[0])) for r in all_rows)
              + f" (P/N = {(total + args.new_tokens - 1) / world:.1f}); cache bytes per rank: "
              + ", ".join(str(int(r[1])) for r in all_rows))
        print(f"cp  tokens: {tokens}")
        print(f"ref tokens: {ref}")
        for name, key in (("prefill", "prefill"), ("time to first token", "ttft")):
            print(f"{name}: cp {cp[key] * 1e3:.1f} ms, one process {ref_times[key] * 1e3:.1f} ms")
        if n > 0:
            print(f"decode: cp {n / cp['decode']:.1f} tok/s, one process "
                  f"{n / ref_times['decode']:.1f} tok/s")
        print(f"generate verdict: {'PASS' if ok[0] else 'FAIL'}")
    dist.destroy_process_group()
    return 0 if ok[0] else 1


if __name__ == "__main__":
    sys.exit(main())
