"""Causal-LM training of a Hugging Face GPT-2 on global tensors (OSLO's data-parallel tutorial).

    python -m sbp.distributed.launch --nproc_per_node 2 examples/gpt2_data_parallel.py

The tutorial's script with its parallel lines changed: the model is made global
(`model.to_global(P, broadcast)`), each batch is split along dim 0, and the
gradients of the broadcast parameters are all-reduced by sbp during backward.
The `transformers` model is unmodified; it makes its own local constants in
`forward` (position ids from `torch.arange`, causal masks), so `forward` runs
inside `sbp.global_mode(P)`, which makes those global too. Everything stays
offline: a small randomly initialised GPT-2 (`GPT2Config` built here), a
character-level tokenizer, and a built-in text corpus. Needs `pip install
torch-sbp[hf]`.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.optim import Adam
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import sbp

CORPUS = (
    "Global tensors spread one logical tensor over the ranks of a placement. "
    "A split signature gives each rank a slice, broadcast gives each rank the whole, "
    "and a partial sum leaves the ranks holding addends of the logical value. "
    "Data parallel training splits every batch along its first dim and broadcasts the model."
)


class CharTokenizer:
    """A byte-level tokenizer with the calling convention of a Hugging Face tokenizer."""

    pad_token_id = eos_token_id = 0
    vocab_size = 256

    def __call__(self, texts, return_tensors="pt", padding=True, truncation=True, max_length=64):
        rows = [[b or 1 for b in t.encode()][: max_length if truncation else None] for t in texts]
        width = max_length if padding == "max_length" else max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != self.pad_token_id).decode(errors="replace")


def make_dataset(n: int, seq_len: int) -> list[str]:
    """`n` overlapping pieces of the corpus, some shorter than `seq_len` (so padding is used)."""
    text = CORPUS * 4
    return [text[7 * i : 7 * i + seq_len - (i % 3)] for i in range(n)]


def make_model(args: argparse.Namespace, tokenizer: CharTokenizer) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=tokenizer.vocab_size,
        n_positions=args.seq_len,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps (TRAIN_STEP)")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank (BATCH_SIZE)")
    parser.add_argument("--seq-len", type=int, default=32, help="SEQ_LEN")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="gpt2_checkpoint", help="where the model is saved")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    device = torch.device("cuda", sbp.env.get_local_rank()) if args.device == "cuda" else "cpu"

    # 1.2 model, optimizer and tokenizer (built locally: no hub downloads)
    tokenizer = CharTokenizer()
    model = make_model(args, tokenizer)

    # 1.3 parallelize the model: every parameter broadcast over all ranks
    P = sbp.placement.all(args.device)
    model.to_global(P, sbp.broadcast)
    model.to(getattr(torch, args.dtype))
    optimizer = Adam(model.parameters(), lr=args.lr)  # after to_global: it holds the global params

    # 1.4 dataset and dataloader
    datasets = make_dataset(args.steps * args.batch_size * world, args.seq_len)
    train_sampler = DistributedSampler(datasets, num_replicas=world, rank=rank, seed=args.seed)
    dataloader = DataLoader(datasets, batch_size=args.batch_size, sampler=train_sampler)

    # 1.5 training as usual
    model.train()
    for step, batch in enumerate(dataloader):
        model.zero_grad()
        input_batch = tokenizer(
            batch,
            return_tensors="pt",
            padding="max_length",  # every rank's slice of the global batch has the same length
            truncation=True,
            max_length=args.seq_len,
        )
        # the pads' labels are -100: not learnt
        labels = input_batch["input_ids"].masked_fill(input_batch["attention_mask"] == 0, -100)
        batch = dict(input_batch, labels=labels)
        batch = sbp.to_global({k: v.to(device) for k, v in batch.items()}, P, sbp.split(0))
        with sbp.global_mode(P):
            # The model, its loss and attention mask included, runs on each rank's shard
            # (sbp's data-parallel fast path). Training needs no KV cache: use_cache=False.
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        value = loss.item()
        if rank == 0:
            print(f"step {step} loss {value!r}", flush=True)

    if rank == 0:  # "fast": on the local shards (sbp/data_parallel/), "per-op": op by op
        print(f"training ran {sbp.nn.fast_path.state(model).last_path}", flush=True)

    # 1.6 save the trained model (plain tensors, from rank 0) and load it back
    state_dict = {k: v.full_tensor() for k, v in model.state_dict().items()}
    probe = tokenizer([CORPUS[: args.seq_len]], max_length=args.seq_len)
    model.eval()
    with torch.no_grad(), sbp.global_mode(P):
        ids = sbp.to_global(probe["input_ids"].to(device), P, sbp.broadcast)  # (no padding)
        trained = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    if rank == 0:
        model.save_pretrained(args.save_dir, state_dict=state_dict)
        loaded = GPT2LMHeadModel.from_pretrained(args.save_dir, dtype=getattr(torch, args.dtype))
        loaded.eval()
        with torch.no_grad():
            reloaded = loaded(**probe, labels=probe["input_ids"]).loss.item()
        print(f"saved to {os.path.abspath(args.save_dir)}")
        print(f"probe loss trained {trained!r} reloaded {reloaded!r}", flush=True)


if __name__ == "__main__":
    main()
