"""Evaluation of the nano model: held-out perplexity, greedy completions, MTP acceptance, and the
export check (checkpoint in tailored's engine and in transformers vs the training forward).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from nano.model import attn_qkv, forward_hidden, forward_mtp, logits, moe, mtp_input, rms1p, rope


def _autocast(device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_tokens: int, batch: int,
                 bf16: bool = False) -> dict:
    """Mean next-token CE (main) and t+2 CE (MTP) over non-overlapping windows of seq_len+1
    tokens of the held-out stream (each window starts from an empty context)."""
    dev = next(model.parameters()).device
    n = min(len(stream) - 1, max_tokens) // seq_len
    if n == 0:
        raise SystemExit("held-out stream shorter than one window; lower --seq-len")
    win = stream[: n * seq_len + 1]
    tot, tot_m, cnt, cnt_m = 0.0, 0.0, 0, 0
    for s in range(0, n, batch):
        idx = torch.arange(s, min(n, s + batch))
        w = torch.stack([win[i * seq_len: i * seq_len + seq_len + 1] for i in idx]).to(dev)
        x, y = w[:, :-1], w[:, 1:]
        with _autocast(dev, bf16):
            h, _ = forward_hidden(model, x, sdpa=bf16)
            lg = logits(model, h).float()
            g, _ = forward_mtp(model, h[:, :-1], x[:, 1:], sdpa=bf16)
            lm = logits(model, g).float()
        tot += F.cross_entropy(lg.flatten(0, 1), y.flatten(), reduction="sum").item()
        tot_m += F.cross_entropy(lm.flatten(0, 1), y[:, 1:].flatten(), reduction="sum").item()
        cnt += y.numel()
        cnt_m += y[:, 1:].numel()
    ce, ce_m = tot / cnt, tot_m / cnt_m
    return {"tokens": cnt, "ce": ce, "ppl": math.exp(ce), "mtp_ce": ce_m, "mtp_ppl": math.exp(ce_m)}


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation by full recomputation (no cache): prompts [B, P] → [B, P+n]."""
    seq = prompts
    for _ in range(n):
        h, _ = forward_hidden(model, seq, sdpa=False)
        nxt = logits(model, h[:, -1]).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def _mtp_layer(model, x, pos0: int, real_kv, chain_kv):
    """The MTP decoder layer for rows r = 0..R−1 at positions pos0 + r, attending to the
    teacher-forced rows 0..r (real_kv; None = this call's own rows, i.e. the teacher-forced
    pass) and to the row-aligned chain entries chain_kv (earlier drafts of the same row) plus
    itself. Returns (post-`mtp.norm` hidden, k, v of these rows)."""
    cfg = model.config
    layer = model.mtp.layers[0]
    mod = layer.self_attn
    B, R, _ = x.shape
    cos, sin = rope(R, cfg, x.device, offset=pos0)
    u = rms1p(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
    q, k, v, gate = attn_qkv(mod, u, cos, sin, cfg)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads

    def heads(t):  # [B, R, Hkv, D] → [B, Hq, R, D]
        return t.repeat_interleave(rep, dim=2).transpose(1, 2)

    qh = q.transpose(1, 2)
    scale = cfg.head_dim ** -0.5
    kr, vr = (k, v) if real_kv is None else real_kv
    s_real = (qh @ heads(kr).transpose(-1, -2)) * scale  # [B, Hq, R, R]
    mask = torch.ones(R, R, dtype=torch.bool, device=x.device).triu(1)
    s_real = s_real.masked_fill(mask, float("-inf"))
    extra = ([] if real_kv is None else list(chain_kv) + [(k, v)])
    s_extra = [((qh * heads(ck)).sum(-1, keepdim=True) * scale) for ck, _ in extra]
    p = torch.softmax(torch.cat([s_real] + s_extra, dim=-1), dim=-1, dtype=torch.float32)
    o = p[..., :R].to(vr.dtype) @ heads(vr)
    for i, (_, cv) in enumerate(extra):
        o = o + p[..., R + i: R + i + 1].to(cv.dtype) * heads(cv)
    o = o.transpose(1, 2).reshape(B, R, -1) * torch.sigmoid(gate)
    h = x + mod.o_proj(o)
    y, _ = moe(layer.mlp, rms1p(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps), cfg)
    return rms1p(h + y, model.mtp.norm.weight, cfg.rms_norm_eps), k, v


@torch.no_grad()
def mtp_drafts(model, seq: torch.Tensor, num_drafts: int):
    """Greedy MTP draft chains for every row of `seq` [B, T] (spec §8.1–§8.2).

    Row t: draft 1 from (h_t, x_{t+1}) at position t (teacher-forced MTP cache of rows ≤ t);
    draft j > 1 from (previous post-norm MTP hidden, draft j−1) at position t+j−1, attending to
    the teacher-forced rows ≤ t and this row's earlier drafts. Returns (drafts [B, T−1, j],
    target [B, T]: the main model's greedy next token after each position).
    """
    h, _ = forward_hidden(model, seq, sdpa=False)
    target = logits(model, h).argmax(-1)
    c = mtp_input(model, h[:, :-1], seq[:, 1:])
    g, k1, v1 = _mtp_layer(model, c, 0, None, [])
    d = logits(model, g).argmax(-1)
    drafts, chain = [d], []
    for j in range(2, num_drafts + 1):
        c = mtp_input(model, g, d)
        g, kj, vj = _mtp_layer(model, c, j - 1, (k1, v1), chain)
        chain.append((kj, vj))
        d = logits(model, g).argmax(-1)
        drafts.append(d)
    return torch.stack(drafts, -1), target


@torch.no_grad()
def mtp_acceptance(model, prompts: torch.Tensor, gen_tokens: int, max_drafts: int = 3) -> dict:
    """Greedy-decode `gen_tokens` after each prompt with the main model, then measure how many of
    the MTP's greedy drafts equal the main model's next greedy tokens.

    For k = 1..max_drafts: per_position = mean over generated positions t of the accepted prefix
    length (drafts d1..dk vs greedy tokens t+2..t+k+1); spec_decode = a simulated greedy
    speculative decode (verify k drafts, accept the matching prefix plus one bonus token, jump),
    reporting mean accepted drafts per verification step and tokens per step (1 + accepted).
    acceptance_rate_1 = P(d1 correct); conditional[j] = P(d_j correct | d_1..d_{j-1} correct).
    """
    P = prompts.shape[1]
    seq = greedy(model, prompts, gen_tokens)
    drafts, target = mtp_drafts(model, seq, max_drafts)
    T = seq.shape[1]
    K = max_drafts
    rows = range(P - 1, T - 1 - K)  # row t: token x_{t+1} was generated, t+K is inside seq
    ok = torch.stack([drafts[:, t, :] == target[:, t + 1: t + 1 + K] for t in rows], 1)  # [B,R,K]
    prefix = ok.long().cumprod(-1)  # prefix[..., j] = drafts 1..j+1 all correct
    out = {"prompts": int(prompts.shape[0]), "prompt_tokens": P, "generated_tokens": gen_tokens,
           "positions": int(ok.shape[0] * ok.shape[1]),
           "acceptance_rate_1": prefix[..., 0].float().mean().item(),
           "conditional": [], "per_position_mean_accepted": {}, "spec_decode": {}}
    for j in range(K):
        prev = prefix[..., j - 1] if j else torch.ones_like(prefix[..., 0])
        num = prefix[..., j].sum().item()
        out["conditional"].append(num / max(1, prev.sum().item()))
    for k in range(1, K + 1):
        acc = prefix[..., :k].sum(-1).cpu()  # [B, R] accepted drafts if verifying k
        out["per_position_mean_accepted"][k] = acc.float().mean().item()
        steps, accepted = 0, 0
        for b in range(acc.shape[0]):
            i = 0
            while i < acc.shape[1]:
                a = int(acc[b, i])
                steps += 1
                accepted += a
                i += a + 1
        out["spec_decode"][k] = {"steps": steps, "mean_accepted": accepted / steps,
                                 "tokens_per_step": 1 + accepted / steps}
    return out


# ---------------------------------------------------------------------------------------------
# export check: the written checkpoint in tailored and in transformers
# ---------------------------------------------------------------------------------------------
def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def engine_logits(ckpt: Path, ids: list[int]) -> torch.Tensor:
    """tailored's Qwen36ForCausalLM (fp32, CPU) loaded from the checkpoint: logits of every row."""
    from tailored.config import ModelConfig
    from tailored.model.batch import ForwardBatch
    from tailored.model.loader import load_checkpoint
    from tailored.synth import build_empty_model
    from tailored.worker.cache import HybridCache

    cfg = ModelConfig.from_dir(ckpt)
    m = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(m, ckpt, progress=False)
    ps = 16
    cache = HybridCache(cfg, num_pages=len(ids) // ps + 3, page_size=ps, num_slots=2,
                        dtype=torch.float32, device="cpu")
    b = ForwardBatch.build([(ids, 0, 1, True, list(range(1, len(ids) // ps + 2)))],
                           range(len(ids)), "cpu")
    return m.compute_logits(m(b, cache))


@torch.no_grad()
def transformers_logits(ckpt: Path, ids: list[int]) -> torch.Tensor | None:
    """transformers' Qwen3_5MoeForCausalLM (fp32, eager) built from config.json text_config with
    the checkpoint's text tensors (mtp.* ignored); None when transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from tailored.gate.reference import reference_from_files

    hf = reference_from_files(ckpt)
    return hf(torch.tensor([ids])).logits[0]


def engine_greedy(ckpt: Path, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy completions through the serving stack (tokenizer → engine → detokenizer), CPU
    fp32, all prompts submitted at once (continuous batching)."""
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack

    stack = build_stack(ckpt, device="cpu", dtype="float32", progress=False, max_model_len=1024,
                        max_num_seqs=max(2, len(prompts)))
    eng = stack.engine
    res = []
    for i, p in enumerate(prompts):
        ids = stack.tokenizer.encode(p)
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        res.append({"prompt": p, "prompt_ids": ids, "ids": [], "text": "", "finish_reason": None})
    while eng.has_unfinished():
        for o in eng.step():
            r = res[int(o.request_id[1:])]
            r["ids"] += o.delta_token_ids
            r["text"] += o.delta_text
            if o.finished:
                r["finish_reason"] = o.finish_reason.value if o.finish_reason else None
    return res
