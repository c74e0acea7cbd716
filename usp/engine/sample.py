"""Sample text from the trained model so a user sees what it learned."""
from __future__ import annotations

import torch


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int, max_seq_len: int, seed: int,
             temperature: float = 0.8, top_k: int = 40) -> list[int]:
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for _ in range(new_tokens):
        logits = model(ids[:, -max_seq_len:])[0, -1].float().cpu() / temperature
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
