"""Draft tokens from the context (prompt lookup), for the sampler to verify.

A tool-using policy copies much of what it writes: a tool call's JSON from the system
prompt's example, the question into its search query, the answer from the retrieved
passages. :func:`lookup` finds the latest earlier place in a row's context (its prompt and
the tokens drawn so far) where the context's last few tokens occur, and proposes the
tokens that followed there. The decoder (:mod:`agentenv.lm.decoding`) runs a row's next
token and its drafts through the model in one forward and draws each position with the
row's own generator in order, keeping drafts while the draw equals them: the row gets
exactly the tokens of drawing one at a time (a draft only saves a forward when it is what
the row draws anyway). In the RAG-v0 recipe's saved episodes (after SFT), up to 4 drafts
from the last 3, 2 or 1 tokens give 2.82 tokens per decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NGRAMS = (3, 2, 1)  # the context's last n tokens looked up, longest first


def lookup(context: Sequence[int], k: int, ngrams: Sequence[int] = NGRAMS) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens of ``context``, for the first ``n`` of ``ngrams`` that occurs; ``[]`` if none
    does (or ``k < 1``).

    >>> lookup([5, 6, 7, 8, 9, 5, 6], k=2)
    [7, 8]
    """
    ids = np.asarray(context, dtype=np.int64)
    total = len(ids)
    if k < 1:
        return []
    for n in ngrams:
        if total <= n:
            continue
        # starts i of earlier copies of the last n tokens, each followed by a token
        found = ids[: total - n] == ids[total - n]
        for j in range(1, n):
            found &= ids[j : total - n + j] == ids[total - n + j]
        starts = np.flatnonzero(found)
        if len(starts):
            i = int(starts[-1]) + n
            return ids[i : i + k].tolist()
    return []
