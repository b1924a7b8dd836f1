"""PyTorch DDP on the workload of a trainer config: the comparison `trainer bench-link --pytorch`
runs on the same shaped links as the trainer, one process per node, gloo, one compute thread.

The model mirrors the trainer's built-in one (same layer shapes, so the same gradient bytes and
about the same FLOPs): `mlp` (Linear + ReLU hidden layers) or `text_transformer` (token and
position embeddings, a pre-norm GELU encoder, mean over the tokens, a linear head). The data is
one random batch, reused: no loading cost, which favours PyTorch. DDP keeps its defaults (a 1 MiB
first bucket, overlap with backward) but takes the config's `[distributed] bucket_cap_mb` (25 MiB
by default on both sides); `--compression bf16` / `fp16` registers PyTorch's
`bf16_compress_hook` / `fp16_compress_hook`.

It times `--steps` steps with gradient sync and as many under `no_sync()` (the same compute and
optimizer, no communication: the step's local work), after `--warmup` steps, and rank 0 prints
one JSON line: {"samples_per_sec", "step_s", "work_s", "params"}.

Environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and GLOO_SOCKET_IFNAME) as
torch.distributed's env:// init reads them.
"""

import argparse
import json
import sys
import time
import tomllib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


class TextClassifier(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.tokens = nn.Embedding(m["vocab_size"], m["d_model"])
        self.positions = nn.Embedding(m["max_len"], m["d_model"])
        layer = nn.TransformerEncoderLayer(
            m["d_model"],
            m["heads"],
            m["d_ff"],
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, m["layers"], enable_nested_tensor=False)
        self.output = nn.Linear(m["d_model"], m.get("classes", 2))

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        x = self.tokens(tokens) + self.positions(positions)
        return self.output(self.encoder(x).mean(dim=1))


def workload(config):
    """The model, one batch (inputs, targets) and the optimizer of `config` (a parsed TOML)."""
    m, data, training = config["model"], config["data"], config["training"]
    batch = training["batch_size"]
    if m["name"] == "mlp":
        sizes = [data.get("features", 784)] + list(m.get("hidden", [])) + [data.get("classes", 10)]
        layers = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        model = nn.Sequential(*layers)
        inputs = torch.randn(batch, sizes[0])
        targets = torch.randint(0, sizes[-1], (batch,))
    elif m["name"] == "text_transformer":
        model = TextClassifier(m)
        length = min(data.get("max_len", m["max_len"]), m["max_len"])
        inputs = torch.randint(0, m["vocab_size"], (batch, length))
        targets = torch.randint(0, m.get("classes", 2), (batch,))
    else:
        print(
            f"the PyTorch comparison knows the models mlp and text_transformer, not {m['name']!r}",
            file=sys.stderr,
        )
        sys.exit(2)
    o = config["optimizer"]
    lr = o.get("learning_rate", 0.01)
    if o["name"] == "sgd":
        optim = lambda p: torch.optim.SGD(p, lr=lr, momentum=o.get("momentum", 0.0))
    elif o["name"] == "adamw":
        optim = lambda p: torch.optim.AdamW(p, lr=lr)
    else:
        optim = lambda p: torch.optim.Adam(p, lr=lr)
    return model, inputs, targets, optim


def timed(ddp, optimizer, inputs, targets, steps, sync):
    """Seconds per step over `steps` steps (after a barrier, on this rank's clock)."""
    loss_fn = nn.CrossEntropyLoss()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if sync:
            loss_fn(ddp(inputs), targets).backward()
        else:
            with ddp.no_sync():
                loss_fn(ddp(inputs), targets).backward()
        optimizer.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--compression", default="none", choices=["none", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-secs", type=int, default=600)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(1)
    with open(args.config, "rb") as f:
        config = tomllib.load(f)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_secs))
    model, inputs, targets, make_optimizer = workload(config)
    # The workload's bucket cap, as the trainer's ([distributed] bucket_cap_mb; both default
    # to 25 MiB), so that both sum the same-sized buckets.
    bucket_cap_mb = config.get("distributed", {}).get("bucket_cap_mb", 25.0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if args.compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = make_optimizer(ddp.parameters())

    timed(ddp, optimizer, inputs, targets, args.warmup, sync=True)
    step_s = timed(ddp, optimizer, inputs, targets, args.steps, sync=True)
    work_s = timed(ddp, optimizer, inputs, targets, args.steps, sync=False)
    if dist.get_rank() == 0:
        samples = inputs.shape[0] * dist.get_world_size()
        params = sum(p.numel() for p in model.parameters())
        print(
            json.dumps(
                {
                    "samples_per_sec": samples / step_s,
                    "step_s": step_s,
                    "work_s": work_s,
                    "params": params,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
