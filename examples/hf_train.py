"""Train a tiny Hugging Face model built from a config (no download) under
cplib context parallelism with ``attn_implementation="cplib"``, and check it
step by step against the same training in one process.

    torchrun --standalone --nproc-per-node 2 examples/hf_train.py                 # gpt-oss
    torchrun --standalone --nproc-per-node 2 examples/hf_train.py --model mistral
    torchrun --standalone --nproc-per-node 4 examples/hf_train.py --ulysses-degree 2 \\
        --model qwen3

Models: ``gpt_oss`` (attention sinks, alternating sliding-window layers, MoE),
``mistral`` (sliding window), ``qwen3`` (GQA), ``deepseek_v3`` (MLA). The
batch is packed documents (``position_ids`` restarting at 0; the context
reads them, so attention stays within each document), unless ``--no-docs``,
placed with the document placement (``load_balance="placement"``: documents
whole on one rank where the balance allows; head-tail with
``--ulysses-degree`` > 1).

Each step every rank trains the CP model on its shards with HF's own loss,
``model(input_ids=ids, position_ids=pos, labels=labels).loss`` (``import
cplib.hf`` registers the attention and makes that loss right under CP: labels
shifted over the whole sequence, normalised by the global count of valid
labels, so the mean over the ranks of the loss and of the gradients is the
single-process value; the gradients are averaged over the ranks, as FSDP
would). Rank 0 trains an identical model with HF's own eager attention on the
full batch, each document on its own. Rank 0 prints both losses and exits
non-zero (FAIL) if they differ by more than ``--atol + --rtol * |ref|``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cplib
import cplib.hf  # noqa: F401  (registers attn_implementation="cplib")

VOCAB = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt_oss", "mistral", "qwen3", "deepseek_v3"),
                   default="gpt_oss")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ulysses-degree", type=int, default=1)
    p.add_argument("--no-docs", action="store_true", help="one document per sequence")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--atol", type=float, default=1e-3)
    p.add_argument("--rtol", type=float, default=1e-3)
    return p.parse_args()


def build(name: str, seq_len: int):
    """A tiny random model of the family, with HF's eager attention."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                  attn_implementation="eager")
    if name == "gpt_oss":
        cfg = tf.GptOssConfig(**common, head_dim=16, sliding_window=32, num_local_experts=4,
                              num_experts_per_tok=2,
                              layer_types=["sliding_attention", "full_attention"])
        return tf.GptOssForCausalLM(cfg)
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, head_dim=16, sliding_window=32))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    common["num_key_value_heads"] = 4  # MLA expands k/v to every head
    cfg = tf.DeepseekV3Config(**common, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, moe_intermediate_size=32)
    return tf.DeepseekV3ForCausalLM(cfg)


def make_batch(step: int, batch: int, seq: int, docs: bool, device: torch.device):
    """Same batch on every rank (seeded by step): ids, position_ids, labels
    (HF's: unshifted, the model shifts them; no label at a document's first
    token, so no token predicts across documents). Each token is the previous
    one's image under a fixed random permutation (a learnable chain), from a
    random start per sequence."""
    g = torch.Generator().manual_seed(1000 + step)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(1, seq):
        ids[:, t] = perm[ids[:, t - 1]]
    bounds = [0, seq // 3, seq // 3 + 5, seq] if docs else [0, seq]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).expand(batch, seq)
    labels = ids.clone()
    for b in bounds[1:-1]:
        labels[:, b] = -100  # no label crosses a document
    return ids.to(device), pos.contiguous().to(device), labels.to(device), bounds


def reference_loss(model, ids, pos, labels, bounds) -> torch.Tensor:
    """One process, each document alone: HF's loss summed over the documents
    (each normalised by the batch's count of valid labels)."""
    count = int((labels[:, 1:] != -100).sum())
    return sum(model(input_ids=ids[:, a:b], position_ids=pos[:, a:b], labels=labels[:, a:b],
                     num_items_in_batch=count, use_cache=False).loss
               for a, b in zip(bounds, bounds[1:]))


def average_grads(model: torch.nn.Module, world: int) -> None:
    """The mean of the gradients over the ranks (FSDP's reduction)."""
    for p in model.parameters():
        if p.grad is None:  # an expert this rank routed no token to
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        import os

        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))

    torch.manual_seed(0)
    ref = build(args.model, args.seq_len).to(device)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("cplib")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)  # used on rank 0 only
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"cplib hf_train: tiny {args.model} ({n_params / 1e3:.0f}k params, "
              f"attn_implementation='cplib'), {args.batch} x {args.seq_len} tokens, {world} "
              f"{device.type} ranks, ulysses_degree={args.ulysses_degree}, "
              f"documents={not args.no_docs}, loss = model(..., labels=labels).loss",
              flush=True)
    ok, worst = True, 0.0
    for step in range(args.steps):
        ids, pos, labels, bounds = make_batch(step, args.batch, args.seq_len, not args.no_docs,
                                              device)
        docs = {} if args.no_docs else {"position_ids": pos.clone()}
        placed = "placement" if docs and args.ulysses_degree == 1 else True
        ids_cp, pos_cp, labels_cp = ids.clone(), pos.clone(), labels.clone()
        with cplib.context_parallel(mesh, buffers=[ids_cp, pos_cp, labels_cp],
                                    buffer_seq_dims=[1, 1, 1], load_balance=placed,
                                    ulysses_degree=args.ulysses_degree, **docs):
            loss = model(input_ids=ids_cp, position_ids=pos_cp, labels=labels_cp,
                         use_cache=False).loss
            loss.backward()
        average_grads(model, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        cp_loss = total.item() / world  # the mean over the ranks: the single-process loss
        if rank != 0:
            continue
        # The reference on rank 0: eager attention, every document on its own.
        ref_loss = reference_loss(ref, ids, pos, labels, bounds)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        diff = abs(cp_loss - ref_loss.item())
        ok &= diff <= args.atol + args.rtol * abs(ref_loss.item())
        worst = max(worst, diff)
        print(f"step {step + 1:3d}/{args.steps}  loss cp {cp_loss:.5f}  eager "
              f"{ref_loss.item():.5f}  |diff| {diff:.1e}", flush=True)
    if rank == 0:
        verdict = "PASS" if ok else "FAIL"
        print(f"hf_train verdict: {verdict}: CP loss with attn_implementation='cplib' "
              f"{'tracks' if ok else 'DIVERGES from'} HF eager in one process (max |diff| "
              f"{worst:.1e}, tolerance {args.atol:g} + {args.rtol:g}*|loss|)", flush=True)
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
