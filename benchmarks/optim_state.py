"""LowBitAdamW's state bytes (memtrim's tracker) and how far its training moves from AdamW's, on the small GPT of
tests/techniques/test_optim_state.py (2 layers, d=32, seq 16, vocab 64, batch 2): 8 steps at lr 1e-3 from the same
weights and batches; the largest and mean absolute parameter difference from torch.optim.AdamW, and the largest
loss difference. No timings.

Reproduce:  .venv/bin/python benchmarks/optim_state.py
Writes benchmarks/results/optim_state_cpu.json.
"""

import torch
import torch.nn.functional as F

import memtrim
from _common import machine, write
from memtrim.models import GPTConfig, SmallGPT

STEPS, LR = 8, 1e-3


def train(make_optimizer):
    torch.manual_seed(0)
    model = SmallGPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64))
    optimizer = make_optimizer(model)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with memtrim.track(model, optimizer) as tracker:
        pass
    return model, losses, tracker.report().final_by_category["optimizer_state"]


def main() -> None:
    plain, plain_losses, plain_state = train(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    rows = {"AdamW (float32 moments)": {"optimizer_state_bytes": plain_state}}
    for bits, label in ((16, "bfloat16"), (8, "float8, blocks of 256"), (4, "4-bit codes, blocks of 128")):
        model, losses, state = train(lambda m, bits=bits: memtrim.LowBitAdamW(m.parameters(), lr=LR, bits=bits))
        diff = torch.cat([(a - b).detach().abs().flatten() for a, b in zip(model.parameters(), plain.parameters())])
        rows[f"LowBitAdamW(bits={bits}): {label}"] = {
            "optimizer_state_bytes": state,
            "max_parameter_difference": diff.max().item(),
            "mean_parameter_difference": diff.mean().item(),
            "max_loss_difference": max(abs(a - b) for a, b in zip(losses, plain_losses)),
        }
    for name, row in rows.items():
        print(name, {k: (f"{v:.2e}" if isinstance(v, float) else f"{v:,}") for k, v in row.items()})
    print("wrote", write("optim_state_cpu.json", {"machine": machine(), "steps": STEPS, "lr": LR, "results": rows}))


if __name__ == "__main__":
    main()
