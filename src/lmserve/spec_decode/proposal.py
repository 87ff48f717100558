"""What every proposer takes and returns: ProposalInput (one request to propose for) and the Proposer protocol.

Below both proposers (proposer.py's n-gram lookup, draft_runner.py's draft model) and the code that picks one
(proposer.make_proposer), so neither imports the other for it. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lmserve.request import Request


@dataclass
class ProposalInput:
    """One request to propose for, as it stands after this step's tokens (not yet appended to the request)."""

    request: Request
    token_ids: list[int]  # prompt + output, this step's accepted and sampled tokens included
    block_ids: list[int]  # its block table (the draft writes its KV through it)
    num_proposals: int  # at most this many tokens (>= 1)

    @property
    def new_token_ids(self) -> list[int]:
        """This step's accepted and sampled tokens (a grammar matcher has not consumed them yet)."""
        return self.token_ids[self.request.num_tokens :]


class Proposer(Protocol):
    def propose(self, inputs: list[ProposalInput]) -> tuple[dict[str, list[int]], dict[str, Any]]:
        """request id → proposed token ids (may be empty), and request id → the draft's distributions
        (num_proposed, vocab) they were drawn from (absent: one-hot)."""
        ...
