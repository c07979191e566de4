"""Prompt log-probabilities: each prompt token's logprob given the tokens before it.

What lm-evaluation-harness's log-likelihood tasks (multiple choice) and OpenAI's legacy `echo`
read, and vLLM's `prompt_logprobs`. A prefill chunk of a request that asks for them carries
the token after each of its rows (`ScheduledSeq.logprob_targets`); here the LM head runs over
those rows only, PROMPT_LOGPROB_ROWS at a time (a [rows, vocab] fp32 block: 254 MB at 256 rows
of the 248k vocabulary), so a long prompt's memory stays bounded and requests that do not ask
pay nothing. Values are the log-softmax of the raw logits (before penalties, temperature and
top-k/p), as vLLM computes its logprobs by default (`raw_logprobs`) and as generated tokens'
logprobs are here; each prompt token also gets its rank (how many tokens are at least as
likely, itself included: 1 for the most likely; vLLM's `rank`). Enqueued with the step; read when the step is collected.
"""

from __future__ import annotations

import math

import torch

from tailored.engine.types import ScheduledSeq, TokenLogprob
from tailored.model.batch import index_on
from tailored.worker.sampler import HostCopy

PROMPT_LOGPROB_ROWS = 256


class PromptLogprobs:
    """The prompt logprobs of one step. items: (seq, its first row in the step's hidden
    states) for every scheduled chunk with logprob_targets."""

    def __init__(self, model, hidden: torch.Tensor, items: list[tuple[ScheduledSeq, int]]):
        self._meta = []  # (request id, first position, count, k)
        chosen, ranks, tops = [], [], []
        dev = hidden.device
        for s, row in items:
            n, k = len(s.logprob_targets), s.sampling.prompt_logprobs or 0
            targets = index_on(s.logprob_targets, dev)
            for a in range(0, n, PROMPT_LOGPROB_ROWS):
                b = min(n, a + PROMPT_LOGPROB_ROWS)
                lp = torch.log_softmax(model.compute_logits(hidden[row + a:row + b]), dim=-1)
                got = lp.gather(1, targets[a:b, None])
                chosen.append(got[:, 0])
                # vLLM's rank: how many tokens are at least as likely (itself included)
                ranks.append((lp >= got).sum(1).to(torch.float32))  # exact below 2^24
                if k:
                    v, i = lp.topk(k, dim=-1)
                    tops.append(torch.cat([i.to(torch.float64), v.to(torch.float64)], 1))
            self._meta.append((s.request_id, s.start_pos + 1, n, k))
        self._chosen = HostCopy(torch.stack([torch.cat(chosen), torch.cat(ranks)]))
        self._tops = HostCopy(torch.cat(tops)) if tops else None

    def read(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """{request id: (position of its first value, TokenLogprobs)} (waits for the step)."""
        chosen, ranks = self._chosen.tolist()
        tops = self._tops.tolist() if self._tops is not None else []
        out, c, t = {}, 0, 0
        for rid, first, n, k in self._meta:
            lps = []
            for j in range(n):
                top = ()
                if k:
                    r = tops[t + j]
                    top = tuple((int(r[m]), _finite(r[k + m])) for m in range(k))
                lps.append(TokenLogprob(_finite(chosen[c + j]), top, max(1, int(ranks[c + j]))))
            out[rid] = (first, lps)
            c += n
            t += n if k else 0
        return out


def _finite(x: float) -> float:
    """x, or -9999.0 where it is no finite number (OpenAI's value for no probability)."""
    return x if math.isfinite(x) else -9999.0
