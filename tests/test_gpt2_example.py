"""examples/gpt2_data_parallel.py on 2 processes through the launcher: its losses equal plain
torch training on one process on the same global batches (dropout 0), training runs on the
data-parallel fast path (the loss `labels=` asks for and the attention mask included), and
the saved model reloads with `from_pretrained` to the trained model's loss."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the GPT-2 example needs the `hf` extra")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt2_data_parallel.py"
ARGS = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--n-embd", "32"]
ARGS += ["--n-layer", "2", "--n-head", "2", "--dtype", "float64", "--lr", "1e-2"]


def _load_example():
    spec = importlib.util.spec_from_file_location("gpt2_data_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_losses(ex, world: int) -> tuple[list[float], float]:
    """Plain torch, one process: step s trains on the concatenation of every rank's batch s."""
    from torch.utils.data import DataLoader, DistributedSampler

    args = ex.parse_args(ARGS)
    tok = ex.CharTokenizer()
    model = ex.make_model(args, tok).to(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = ex.make_dataset(args.steps * args.batch_size * world, args.seq_len)
    loaders = [
        DataLoader(
            data,
            batch_size=args.batch_size,
            sampler=DistributedSampler(data, num_replicas=world, rank=r, seed=args.seed),
        )
        for r in range(world)
    ]
    losses = []
    model.train()
    for batches in zip(*loaders, strict=True):
        texts = [t for b in batches for t in b]
        inputs = tok(texts, padding="max_length", truncation=True, max_length=args.seq_len)
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        model.zero_grad()
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    probe = tok([ex.CORPUS[: args.seq_len]], max_length=args.seq_len)
    with torch.no_grad():
        probe_loss = model(**probe, labels=probe["input_ids"]).loss.item()
    return losses, probe_loss


def test_gpt2_example_matches_one_process_and_reloads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "sbp.distributed.launch", "--master_port", str(_free_port())]
    cmd += ["--nproc_per_node", "2", str(EXAMPLE), *ARGS, "--save-dir", str(tmp_path / "ck")]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ref_losses, ref_probe = _reference_losses(_load_example(), 2)  # while the workers run
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"

    assert "training ran fast" in out, out  # the loss inside the forward: on the fast path
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == len(ref_losses) == 3, out
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)

    probe = re.search(r"probe loss trained (\S+) reloaded (\S+)", out)
    assert probe, out
    trained, reloaded = float(probe.group(1)), float(probe.group(2))
    assert (tmp_path / "ck" / "config.json").exists()
    torch.testing.assert_close(trained, ref_probe, rtol=1e-6, atol=0)
    torch.testing.assert_close(reloaded, trained, rtol=1e-12, atol=0)
