"""Mixture of experts in one process: the MoE layer against its slow reference, routing and the aux
loss, MoE Llama training and parameter counts (expert parallelism: tests/e2e/test_moe.py)."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_moe import compose_model
from usp.models.llama import Llama, LlamaArgs
from usp.models.moe import MoE, moe_aux_loss, moe_layers
from usp.perf.specs import Arch

REPO = Path(__file__).resolve().parents[2]
ARCH = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
MOE = ("n_experts", "top_k", "moe_ffn_dim", "shared_expert")


def moe_layer(dim=32, n_experts=4, top_k=2, ffn_dim=48, seed=0, **kw) -> MoE:
    args = SimpleNamespace(dim=dim, n_experts=n_experts, top_k=top_k, ffn_dim=ffn_dim, moe_ffn_dim=0,
                           shared_expert=False, capacity_factor=0.0, router_bias_update_rate=0.0)
    for k, v in kw.items():
        setattr(args, k, v)
    torch.manual_seed(seed)
    m = MoE(args)
    with torch.no_grad():  # larger than the 0.02 init: decisive routing, O(1) outputs
        for name, p in m.named_parameters():
            p.normal_(0.0, 0.3 if name.startswith("router") else 0.1)
    return m


# -------------------------------------------------------------- layer vs reference

@pytest.mark.parametrize("capacity_factor,shared,top_k,norm", [(0.0, False, 2, True), (0.0, True, 1, True),
                                                               (1.0, False, 2, True), (0.5, True, 2, True),
                                                               (0.75, False, 3, True), (0.0, False, 2, False),
                                                               (1.0, False, 3, False)])
def test_forward_and_grads_match_dense_reference(capacity_factor, shared, top_k, norm):
    """norm False: the top-k probabilities weight the experts as they are (Qwen3-MoE's norm_topk_prob=false)."""
    m = moe_layer(capacity_factor=capacity_factor, shared_expert=shared, top_k=top_k, router_norm_topk=norm)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(3, 20, 32, generator=g), torch.randn(3, 20, 32, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = m(x1)
    if capacity_factor:
        assert m.tokens_dropped > 0  # the capacity limit is exercised
    else:
        assert m.tokens_dropped == 0
    grads = torch.autograd.grad(y, [x1, *m.parameters()], dy)
    ref = m.dense_reference(x2)
    ref_grads = torch.autograd.grad(ref, [x2, *m.parameters()], dy)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    top_w, _, _ = m.route(x.reshape(-1, 32))
    assert torch.allclose(top_w.sum(-1), torch.ones(60)) == norm  # renormalised, or the softmax's share
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("groups,topk_groups,norm,capacity_factor", [(4, 2, True, 0.0), (4, 1, False, 0.0),
                                                                     (1, 1, True, 0.0), (2, 1, True, 1.0)])
def test_deepseek_routing_matches_dense_reference(groups, topk_groups, norm, capacity_factor):
    """DeepSeek-V3's router: sigmoid scores, a random correction bias picking the experts (the aux-loss-free
    expert_bias, present with sigmoid scores), group-limited top-k, the weights scaled by 2.5, a shared
    expert twice an expert's width; against the reference's token-by-token choice, values and gradients."""
    m = moe_layer(n_experts=8, shared_expert=True, n_shared_experts=2, router_score="sigmoid", router_groups=groups,
                  router_topk_groups=topk_groups, router_scale=2.5, router_norm_topk=norm,
                  capacity_factor=capacity_factor)
    assert m.expert_bias is not None and m.shared_expert is not None
    assert m.shared_expert.w1.weight.shape == (2 * 48, 32)
    with torch.no_grad():
        m.expert_bias.uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 24, 32, generator=g), torch.randn(2, 24, 32, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ref = m(x1), m.dense_reference(x2)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(y, [x1, *m.parameters()], dy)
    for a, b in zip(grads, torch.autograd.grad(ref, [x2, *m.parameters()], dy)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # expert gradients reach 15: relative rounding
    top_w, top_e, _ = m.route(x.reshape(-1, 32))
    if norm:  # renormalised then scaled
        torch.testing.assert_close(top_w.sum(-1), torch.full((48,), 2.5))
    if topk_groups < groups:  # every pick inside the token's allowed groups
        per_token_groups = {(t, int(e) // (8 // groups)) for t, row in enumerate(top_e) for e in row}
        assert max(sum(1 for tt, _ in per_token_groups if tt == t) for t in range(48)) <= topk_groups


def test_capacity_keeps_first_tokens_in_order():
    m = moe_layer(n_experts=4, top_k=1, capacity_factor=1.0)
    T = 16
    top_e = torch.zeros(T, 1, dtype=torch.long)  # every token wants expert 0; capacity = 4
    tok, slot, e_sorted, counts = m.dispatch_plan(top_e)
    assert tok.tolist() == [0, 1, 2, 3] and counts.tolist() == [4, 0, 0, 0] and m.tokens_dropped == 12


def test_topk_weights_renormalised():
    m = moe_layer(n_experts=6, top_k=3)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    w, e, probs = m.route(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(50))
    torch.testing.assert_close(w, probs.gather(1, e) / probs.gather(1, e).sum(-1, keepdim=True))
    assert (probs.gather(1, e).min(-1).values >= probs.topk(3, -1).values[:, -1]).all()


def test_aux_loss_formula_and_uniform_routing():
    E, k = 4, 2
    m = moe_layer(dim=E, n_experts=E, top_k=k)
    x = torch.randn(40, E, generator=torch.Generator().manual_seed(3))
    m(x)
    probs = F.softmax(m.router(x), -1)
    f = torch.bincount(probs.topk(k, -1).indices.flatten(), minlength=E).float() / (40 * k)
    torch.testing.assert_close(m.aux_loss, E * (f * probs.mean(0)).sum())
    assert m.aux_loss.requires_grad  # gradient reaches the router through P
    # Perfectly uniform: token i prefers experts i and i+1 (cyclic), so f_e = P_e = 1/E by symmetry.
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(E))
    x = torch.stack([3 * F.one_hot(torch.tensor(i), E) + 1.5 * F.one_hot(torch.tensor((i + 1) % E), E)
                     for i in range(E)]).float().repeat(5, 1)
    m(x)
    assert abs(m.aux_loss.item() - 1.0) < 1e-6
    # Everything on one expert pair: well above 1.
    m(x[:1].repeat(8, 1))
    assert m.aux_loss.item() > 1.5


def test_sequence_balance_loss_is_deepseeks_formula():
    """aux_loss_scope=sequence on a tiny batch (2 sequences of 3 tokens, 4 sigmoid-scored experts, top-2)
    equals DeepSeek-V3's eqs. 17-20 computed by hand in plain Python: per sequence, f_i = N_r / (K_r T) x
    the tokens whose top-K holds i, s'_{i,t} = s_{i,t} / sum_j s_{j,t}, P_i = mean_t s'_{i,t},
    L = sum_i f_i P_i; averaged over the sequences. It differs from the global-batch form on the same
    batch, and trains the router."""
    E, k, B, T = 4, 2, 2, 3
    m = moe_layer(dim=8, n_experts=E, top_k=k, router_score="sigmoid", aux_loss_scope="sequence")
    x = torch.randn(B, T, 8, generator=torch.Generator().manual_seed(5))
    m(x)
    scores = torch.sigmoid(x @ m.router.weight.detach().T).tolist()  # [b][t][i]
    losses = []
    for seq in scores:
        top = [sorted(range(E), key=lambda i, s=s: -s[i])[:k] for s in seq]
        f = [E / (k * T) * sum(i in chosen for chosen in top) for i in range(E)]
        p = [sum(s[i] / sum(s) for s in seq) / T for i in range(E)]
        losses.append(sum(fi * pi for fi, pi in zip(f, p)))
    assert abs(m.aux_loss.item() - sum(losses) / B) < 1e-6, (m.aux_loss.item(), losses)
    m.aux_loss.backward()
    assert m.router.weight.grad.abs().max() > 1e-4
    whole = moe_layer(dim=8, n_experts=E, top_k=k, router_score="sigmoid")  # the same weights, batch scope
    whole(x)
    assert abs(whole.aux_loss.item() - m.aux_loss.item()) > 1e-3
    with pytest.raises(ValueError, match="aux_loss_scope='token'"):
        moe_layer(aux_loss_scope="token")


def test_expert_bias_picks_experts_but_not_gate_weights():
    """Aux-loss-free balancing (DeepSeek-V3): the bias decides the top-k choice; the gate weights
    stay the router probabilities of the chosen experts, renormalised."""
    m = moe_layer(n_experts=4, top_k=1, router_bias_update_rate=0.1)
    assert m.expert_bias is not None and "expert_bias" in m.state_dict()  # a buffer: checkpoints keep it
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    _, chosen, probs = m.route(x)
    with torch.no_grad():
        m.expert_bias[0] = 10.0  # expert 0 beats any probability
    w, e, probs2 = m.route(x)
    assert (e == 0).all() and not (chosen == 0).all()
    torch.testing.assert_close(probs2, probs)
    torch.testing.assert_close(w, torch.ones_like(w))  # top-1: renormalised to 1 whatever the bias
    y, ref = m(x), m.dense_reference(x)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)


def test_expert_bias_update_follows_the_step_load():
    """bias += rate * sign(mean load - load), centred; from the tokens counted in training forwards
    of the step (eval forwards don't count), then cleared."""
    m = moe_layer(n_experts=4, top_k=2, router_bias_update_rate=0.01)
    assert moe_layer(n_experts=4).expert_bias is None  # off: no buffer, the state dict is unchanged
    g = torch.Generator().manual_seed(6)
    m(torch.randn(30, 32, generator=g))
    m(torch.randn(10, 32, generator=g))
    m.eval()
    m(torch.randn(50, 32, generator=g))
    tokens = m.take_step_tokens()
    assert int(tokens.sum()) == (30 + 10) * 2 and m.take_step_tokens() is None
    m.update_expert_bias(tokens)
    sign = torch.sign(tokens.float().mean() - tokens.float())
    torch.testing.assert_close(m.expert_bias, 0.01 * (sign - sign.mean()))
    assert m.expert_bias.abs().sum() > 0


def test_recompute_does_not_count_tokens_twice():
    from torch.utils.checkpoint import checkpoint

    m = moe_layer(n_experts=4, top_k=2)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(7), requires_grad=True)
    checkpoint(m, x, use_reentrant=False).sum().backward()  # the forward runs again in the backward
    assert int(m.take_step_tokens().sum()) == 12 * 2


# ------------------------------------------------------------------- model + math

def _cfg_with_vocab(name: str, vocab: int):
    cfg = compose_model(name)
    return SimpleNamespace(**{**{k: getattr(cfg, k) for k in (*ARCH, *MOE, "capacity_factor", "aux_loss_coef")},
                              "vocab_size": vocab})


def test_moe_tiny_llama_trains_and_counts_params():
    cfg = _cfg_with_vocab("moe_tiny", 256)
    model = Llama.from_config(cfg, vocab_size=256, max_seq_len=32)
    assert len(moe_layers(model)) == cfg.n_layers == 2
    n = sum(p.numel() for p in model.parameters())
    assert n == Arch.from_model(cfg).total_params
    b = Arch.from_model(cfg).parts
    assert b["mlp"] == sum(p.numel() for p in model.layers["0"].feed_forward.parameters())
    assert b["experts"] == sum(p.numel() for p in model.layers["0"].feed_forward.experts.parameters())
    ffn = model.layers["0"].feed_forward.experts  # init: N(0, std), w2 scaled like the dense w2
    assert abs(ffn.w1.std().item() - 0.02) < 1e-3
    assert abs(ffn.w2.std().item() - 0.02 / math.sqrt(2 * cfg.n_layers)) < 1e-3
    toks = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        logits = model(toks[:, :-1])
        aux = moe_aux_loss(model)
        loss = F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()) + cfg.aux_loss_coef * aux
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert 0.5 < aux.item() / cfg.n_layers < 2.0
    assert losses[-1] < losses[0] - 0.1, losses


def test_init_is_deterministic_per_name():
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=50, n_experts=4)
    a, b = Llama(args, max_seq_len=8), Llama(args, max_seq_len=8)
    a.init_weights(7)
    b.init_weights(7)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("kw", [dict(n_experts=4, top_k=2), dict(n_experts=3, top_k=1, shared_expert=True),
                                dict(n_experts=8, top_k=2, moe_ffn_dim=24, n_kv_heads=2, tie_embeddings=False)])
def test_param_count_matches_moe_models(kw):
    full = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=None, ffn_dim=64, vocab_size=50, tie_embeddings=True,
                moe_ffn_dim=0, shared_expert=False)
    full.update(kw)
    m = Llama(LlamaArgs(**full), max_seq_len=8)
    arch = Arch.from_model(SimpleNamespace(**full))
    assert sum(p.numel() for p in m.parameters()) == arch.total_params
    ffn = m.layers["0"].feed_forward
    one = sum(p[0].numel() for p in ffn.experts.parameters())
    shared = sum(p.numel() for p in ffn.shared_expert.parameters()) if ffn.shared_expert else 0
    per_token_mlp = full["top_k"] * one + ffn.router.weight.numel() + shared
    seq = 16
    matmul = full["n_layers"] * (arch.parts["attention"] + per_token_mlp) + 50 * 32
    assert arch.flops_per_token(seq) == 6 * matmul + 12 * 2 * 32 * seq


# -------------------------------------------------------------- expert parallelism


def test_attached_aux_loss_gives_the_added_aux_loss_gradients():
    """AttachAuxLoss (what pipeline stages use) == adding coef x aux to the loss, single process."""
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, ffn_dim=64, vocab_size=64, n_experts=4, top_k=2)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for attach in (False, True):
        model = Llama(args, max_seq_len=8).double()
        model.init_weights(0)
        for m in moe_layers(model):
            m.aux_loss_scale = 0.5 if attach else 0.0
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        (loss if attach else loss + 0.5 * moe_aux_loss(model)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    router = "layers.0.feed_forward.router.weight"
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=0, atol=1e-12) for n in grads[0])
    assert grads[1][router].abs().max() > 0


def test_verify_names_the_step_and_layer_where_routing_parts():
    from usp.engine.verify_worker import routing_divergence

    def rec(step, tokens):
        return {"step": step, "expert_load": {"1": {"tokens": tokens}}}

    ref = [rec(1, [3, 5]), rec(2, [4, 4]), rec(3, [2, 6])]
    assert routing_divergence(ref, ref) is None
    got = routing_divergence(ref, [rec(1, [3, 5]), rec(2, [5, 3]), rec(3, [2, 6])])
    assert got == {"step": 2, "layer": "1", "reference": [4, 4], "layout": [5, 3]}
    assert routing_divergence([{"step": 1, "loss": 1.0}], [{"step": 1, "loss": 1.0}]) is None  # a dense model


@pytest.mark.parametrize("q_lora_rank,mtp", [(96, 0), (0, 0), (96, 1)])
def test_param_count_and_flops_match_deepseek_models(q_lora_rank, mtp):
    """The planner's closed forms for DeepSeek-V3's options against the model built: latent attention (with
    and without the low-rank q), a dense first block, a shared expert twice an expert's width; FLOPs per token
    with each block's own active matmuls and the attention matmuls at (q width + value width) / 2."""
    from usp.config.compose import compose_config

    cfg, _ = compose_config(None, ["model=deepseek_v3_tiny", "model.vocab_size=50", f"model.q_lora_rank={q_lora_rank}",
                                   "model.n_shared_experts=2", f"model.mtp_depth={mtp}"])
    m = Llama(LlamaArgs.from_config(cfg.model), max_seq_len=8)
    arch = Arch.from_model(cfg.model)
    assert sum(p.numel() for p in m.parameters()) == arch.total_params
    dense, moe = m.layers["0"], m.layers["1"]
    assert not isinstance(dense.feed_forward, MoE) and isinstance(moe.feed_forward, MoE)
    attention = sum(p.numel() for n, p in dense.attention.named_parameters() if not n.endswith("norm.weight"))
    assert attention == arch.parts["attention"]
    ffn = moe.feed_forward
    assert ffn.shared_expert is not None and ffn.shared_expert.w1.weight.shape[0] == 2 * 64
    one = sum(p[0].numel() for p in ffn.experts.parameters())
    moe_token = attention + 2 * one + ffn.router.weight.numel() + sum(p.numel() for p in ffn.shared_expert.parameters())
    dense_token = attention + sum(p.numel() for p in dense.feed_forward.parameters())
    seq, heads = 16, 4
    mtp_token = mtp * (moe_token + 2 * 128 * 128 + 50 * 128)  # its block, eh_proj, the head again
    matmul = dense_token + 2 * moe_token + mtp_token + 50 * 128
    assert arch.flops_per_token(seq) == 6 * matmul + 12 * (3 + mtp) * heads * ((32 + 16) + 32) // 2 * seq


def test_multi_token_prediction_adds_its_loss_gradient():
    """model.mtp_depth=1: the logits are the model's without it, and the gradients those of CE + coef x the MTP
    cross-entropy, written out here: at position i, [enorm(embedding of t(i+1)) | hnorm(last hidden state at
    i)] -> eh_proj -> the MTP block -> head_norm -> the shared head predicts t(i+2), for i < s - 2."""
    from usp.config.compose import compose_config
    from usp.models.llama import TransformerBlock

    cfg, _ = compose_config(None, ["model=deepseek_v3_tiny", "model.vocab_size=64", "model.mtp_depth=1"])
    model = Llama(LlamaArgs.from_config(cfg.model), max_seq_len=32)
    mtp = model.layers["3"]
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens)
    model.mtp_loss_scale = 0.3
    logits = model(tokens)
    assert torch.equal(logits, plain) and model.mtp_loss is not None
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n.startswith("layers.3.") and "experts" not in n)
    model.zero_grad()
    model.mtp_loss_scale = 0.0  # by hand: the main stack, then the MTP module
    cos, sin = model.rope_cos[:24], model.rope_sin[:24]
    h = model.tok_embeddings(tokens)
    for i in range(3):
        h = model.layers[str(i)](h, cos, sin)
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), labels.flatten())
    following = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)  # t(i+1); the last position's is never scored
    x = mtp.eh_proj(torch.cat((mtp.enorm(model.tok_embeddings(following)), mtp.hnorm(h)), dim=-1))
    ahead = model.output(mtp.head_norm(TransformerBlock.forward(mtp, x, cos, sin)))[:, :-2]
    extra = F.cross_entropy(ahead.flatten(0, 1), tokens[:, 2:].flatten())
    torch.testing.assert_close(model.mtp_loss, extra.detach(), rtol=1e-6, atol=0)
    (main + 0.3 * extra).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)
