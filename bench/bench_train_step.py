"""Training-step throughput: our BERT vs transformers' BertForPreTraining, same shape.

One step = forward + MLM/NSP loss + backward + AdamW step, fp32, dropout on, the same
batch for both (token ids, segment ids, a padding mask with some padding, MLM labels on
15% of positions, NSP labels). The loss is computed by the same code from each model's
logits, so only the models differ.

The two models are measured interleaved (A B, B A, A B, ...) so slow phases of a shared
machine hit both alike; the ratio of medians is reported, and the per-round ratios too.

    python bench/bench_train_step.py                      # bert-base, batch 8 x seq 128
    python bench/bench_train_step.py --preset bert-tiny --steps 20
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from pipeline.export.hf import hf_bert_model
from pipeline.models import build_model, resolve_model_config

VOCAB = 30522  # bert-base-uncased's vocabulary size


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq // 2 :] = 1
    attention_mask = torch.ones_like(input_ids)
    attention_mask[batch // 2 :, seq - seq // 8 :] = 0  # half the rows end in padding
    mlm_labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, input_ids, -100)
    mlm_labels[attention_mask == 0] = -100
    nsp_labels = torch.randint(0, 2, (batch,), generator=g)
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "mlm_labels": mlm_labels,
        "nsp_labels": nsp_labels,
    }


def loss_fn(mlm_logits, nsp_logits, b) -> torch.Tensor:
    mlm = F.cross_entropy(mlm_logits.flatten(0, 1), b["mlm_labels"].flatten(), ignore_index=-100)
    return mlm + F.cross_entropy(nsp_logits, b["nsp_labels"])


def ours_step(model, opt, b):
    out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"])
    loss = loss_fn(out["mlm_logits"], out["nsp_logits"], b)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def hf_step(model, opt, b):
    out = model(
        input_ids=b["input_ids"],
        token_type_ids=b["token_type_ids"],
        attention_mask=b["attention_mask"],
    )
    loss = loss_fn(out.prediction_logits, out.seq_relationship_logits, b)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def build_pair(preset: str):

    cfg = resolve_model_config({"arch": "bert", "preset": preset}, VOCAB)
    torch.manual_seed(0)
    ours = build_model("bert", cfg).train()
    # the export's own mapping of our config to transformers': the same model, by construction
    hf = hf_bert_model(cfg, roles={}).train()
    return cfg, ours, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="bert-base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (one step per model each)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg, ours, hf = build_pair(args.preset)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{args.threads} threads, {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}"
    )
    print(
        f"bert preset {args.preset}: L={cfg.num_layers} H={cfg.hidden_size} "
        f"heads={cfg.num_heads} I={cfg.intermediate_size}; batch {args.batch} x seq {args.seq}, "
        f"fp32, AdamW, dropout on; hf attn = {hf.config._attn_implementation}"
    )
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    print(
        f"params: ours {n_ours / 1e6:.2f}M (vocab padded to {cfg.padded_vocab_size}), "
        f"transformers {n_hf / 1e6:.2f}M"
    )

    batch = make_batch(args.batch, args.seq, VOCAB)
    runners = {
        "ours": (ours_step, ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
        "transformers": (hf_step, hf, torch.optim.AdamW(hf.parameters(), lr=1e-4)),
    }
    for step, model, opt in runners.values():
        for _ in range(args.warmup):
            step(model, opt, batch)

    # Wall time, and CPU time of this process: on a machine shared with other jobs the
    # latter is far less disturbed by waiting for a core (read it with --threads 1, where
    # no OpenMP worker spins at a barrier and inflates it).
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for r in range(args.steps):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
            step, model, opt = runners[name]
            w0, c0 = time.perf_counter(), time.process_time()
            step(model, opt, batch)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
        print(
            f"round {r}: wall ours {wall['ours'][-1]:.3f}s hf {wall['transformers'][-1]:.3f}s | "
            f"cpu ours {cpu['ours'][-1]:.3f}s hf {cpu['transformers'][-1]:.3f}s",
            flush=True,
        )

    tokens = args.batch * args.seq
    for label, times in (("wall", wall), ("cpu", cpu)):
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, m in med.items():
            print(
                f"{label:>4} {name:>13}: median {m:.3f}s/step  {tokens / m:8.1f} tokens/s  "
                f"(min {min(times[name]):.3f}s, max {max(times[name]):.3f}s)"
            )
        rounds = [h / o for o, h in zip(times["ours"], times["transformers"], strict=True)]
        print(
            f"{label:>4} speed ratio ours/transformers (hf median step time / ours): "
            f"{med['transformers'] / med['ours']:.3f}x; per round: "
            + ", ".join(f"{x:.2f}" for x in rounds)
        )


if __name__ == "__main__":
    main()
