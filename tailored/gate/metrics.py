"""Gate metrics: reference vs engine, per position, per prompt, overall.

Positions: for prompt ids (T tokens) + the engine's greedy continuation (N tokens), position p in
[0, T+N-1) is the logits row that predicts token p+1; both models are teacher-forced on the same
tokens. Units: logits and logprobs in nats; KL in nats.

  top-1 agreement   argmax(engine) == argmax(reference), share of scored positions
  top-1 decisive    the same share over the positions that are not ties: a disagreement is a
                    tie when logit_ref[argmax_ref] − logit_ref[argmax_eng] ≤ tie_logit_gap (the
                    reference itself hardly prefers its token; same rule as greedy ties)
  KL(ref ‖ engine)  Σ_v p_ref(v) · (log p_ref(v) − log p_eng(v)), mean and max over positions
  max |logit err|   max over positions and vocabulary of |logit_eng − logit_ref|
  greedy match      length of the common prefix of the engine's and the reference's greedy
                    continuations. Computed without decoding the reference: its greedy token
                    after prompt + e_<k is argmax_ref at position T−1+k of the teacher-forced
                    pass over prompt + engine tokens e, so the prefixes agree up to the first k
                    where that argmax ≠ e_k (exact, not an approximation).
                    A divergence at k is a *tie* when the reference hardly prefers its own token:
                    logit_ref[argmax] − logit_ref[e_k] ≤ tie_logit_gap (then its top-2 gap is ≤
                    tie_logit_gap too). Ties are excepted from the match share and reported.
"""

from __future__ import annotations

import math

import torch


def scored_positions(num_prompt: int, num_new: int, max_positions: int) -> list[int]:
    """Positions compared for one prompt (sorted). All of them when there are ≤ max_positions
    (0 = no limit); otherwise every position predicting a continuation token (T−1 … T+N−2) plus
    prompt positions spaced evenly over [0, T−2] — the vocab projection of 8k positions costs
    more than the whole forward on the CPU, and the spacing still samples every region."""
    total = num_prompt + num_new - 1
    if max_positions <= 0 or total <= max_positions:
        return list(range(total))
    tail = list(range(num_prompt - 1, total))
    k = max(max_positions - len(tail), 2)
    last = num_prompt - 2
    head = sorted({i * last // (k - 1) for i in range(k)}) if last > 0 else [0]
    return head + tail


@torch.no_grad()
def compare_logits(ref: torch.Tensor, eng: torch.Tensor, top_k: int = 5) -> dict[str, torch.Tensor]:
    """ref, eng: logits [n, V] fp32 → per position: agree [n] bool, kl [n], max_err [n],
    ref_argmax [n], ref_max [n] (its logit), ref_second [n] (2nd largest logit), and the
    reference's top_k (ids, logprobs) [n, k].

    KL is computed from d = ref − eng as E_p[d] + log1p(E_p[expm1(−d)]) (an identity): no
    difference of two large log-sum-exps, so fp32 rounding leaves ~1e-12, not ~1e-7, and the
    fp32 gate can bound KL tightly.
    """
    # in place and fused where possible: this runs over [n, 248320] and dominated the CPU gate
    ref_max, ref_arg = ref.max(-1)
    p = torch.sub(ref, ref_max[:, None]).exp_()
    z = p.sum(-1)
    p /= z[:, None]
    d = torch.sub(ref, eng)
    err = torch.linalg.vector_norm(d, float("inf"), -1)
    e_d = torch.linalg.vecdot(p, d)
    big = d.amin(-1) < -20  # exp(-d) would overflow fp32: shift by the max (precision is moot)
    log_e = torch.log1p(torch.linalg.vecdot(p, d.neg_().clamp_max_(20).expm1_()))  # log E_p[e^-d]
    if big.any():
        nd = (eng[big] - ref[big])
        m = nd.amax(-1, keepdim=True)
        log_e[big] = m[:, 0] + torch.log(torch.linalg.vecdot(p[big], (nd - m).exp_()))
    top_v, top_ids = ref.topk(top_k, -1)
    lse = ref_max + z.log()
    eng_arg = eng.argmax(-1)
    ref_at_eng = ref.gather(-1, eng_arg[:, None])[:, 0]
    return {"agree": ref_arg == eng_arg, "ref_at_eng_argmax": ref_at_eng,
            "kl": (e_d + log_e).clamp_min(0),
            "max_err": err, "ref_argmax": ref_arg, "ref_max": ref_max, "ref_second": top_v[:, 1],
            "top_ids": top_ids, "top_logprobs": top_v - lse[:, None]}


def compare_greedy(ref_argmax: list[int], eng_tokens: list[int], ref_max: list[float],
                   ref_at_eng: list[float], ref_second: list[float], tie_logit_gap: float) -> dict:
    """Greedy agreement from the teacher-forced reference (see the module docstring).

    Per continuation step k: ref_argmax[k], ref_max[k] = its logit, ref_at_eng[k] = the
    reference's logit of the engine's token e_k, ref_second[k] = the reference's 2nd logit.
    """
    n = 0
    while n < len(eng_tokens) and ref_argmax[n] == eng_tokens[n]:
        n += 1
    d = {"match_len": n, "identical": n == len(eng_tokens), "tie": False}
    if n < len(eng_tokens):
        gap = ref_max[n] - ref_at_eng[n]
        d.update(diverged_at=n, ref_token=ref_argmax[n], engine_token=eng_tokens[n],
                 ref_gap_top2=ref_max[n] - ref_second[n], ref_gap_to_engine_token=gap,
                 tie=gap <= tie_logit_gap)
    return d


def greedy_verdict(g: dict, num_new: int, min_match_tokens: int) -> str:
    """'match' (≥ min(min_match_tokens, N) tokens agree), 'tie' (diverged earlier at a tie) or
    'mismatch'."""
    if g["match_len"] >= min(min_match_tokens, num_new):
        return "match"
    return "tie" if g["tie"] else "mismatch"


def overall(prompts: list[dict]) -> dict:
    """Pool per-prompt sums (keys positions, agree, kl_sum, kl_max, max_logit_err, verdict)."""
    pos = sum(p["positions"] for p in prompts)
    ties = sum(p.get("top1_ties", 0) for p in prompts)
    agree = sum(p["agree"] for p in prompts)
    v = [p["greedy"]["verdict"] for p in prompts]
    judged = v.count("match") + v.count("mismatch")
    return {
        "prompts": len(prompts),
        "positions": pos,
        "top1": agree / max(pos, 1),
        "top1_ties": ties,
        "top1_decisive": agree / max(pos - ties, 1),
        "kl_mean": sum(p["kl_sum"] for p in prompts) / max(pos, 1),
        "kl_max": max((p["kl_max"] for p in prompts), default=0.0),
        "max_logit_err": max((p["max_logit_err"] for p in prompts), default=0.0),
        "greedy_match": v.count("match"),
        "greedy_tie": v.count("tie"),
        "greedy_mismatch": v.count("mismatch"),
        # ties are excepted: the share is over prompts that matched or truly mismatched
        "greedy_match_fraction": v.count("match") / judged if judged else 1.0,
    }


def breaches(o: dict, th: dict) -> list[str]:
    """Threshold breaches of the overall numbers (a null threshold is not enforced)."""
    out = []
    checks = [("min_top1", "top1", 1), ("min_top1_decisive", "top1_decisive", 1),
              ("max_kl_mean", "kl_mean", -1),
              ("max_logit_err", "max_logit_err", -1),
              ("min_match_fraction", "greedy_match_fraction", 1)]
    for key, metric, sign in checks:
        lim = th.get(key)
        if lim is None:
            continue
        val = o[metric]
        if (sign > 0 and val < lim) or (sign < 0 and val > lim) or math.isnan(val):
            out.append(f"{metric} = {val:.6g} breaches {key} = {lim:g}")
    return out
