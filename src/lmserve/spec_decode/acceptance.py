"""Per-request adaptive speculation: how many tokens to propose for a request, from its recent acceptance
(AcceptanceTracker). Outputs do not change whatever k is chosen. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.7  # weight of the history at each verification (recent verifications count most)
BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 32


@dataclass
class AcceptanceTracker:
    """Exponentially weighted counts of proposals tested and accepted; r = accepted / tested.

    Proposal j is reached and accepted with probability about r^j and costs a draft step plus a verified row, so
    k = the largest j <= num_speculative_tokens with r^j >= adaptive_threshold. When even j = 1 fails the request
    backs off (BACKOFF_STEPS, doubling per failed probe up to MAX_BACKOFF_STEPS), then probes with one proposal.
    """

    tested: float = 0.0  # proposals verified up to the first rejection (a rejection counts, later ones do not)
    accepted: float = 0.0
    backoff: int = 0  # steps to skip after the last failed probe (0: speculation on)
    num_skipped: int = 0  # steps skipped since then

    @property
    def rate(self) -> float | None:
        """Estimated chance that one proposal is accepted (None before any verification)."""
        return self.accepted / self.tested if self.tested else None

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verification: the first num_accepted proposals accepted, the next (if any) rejected."""
        tested = num_accepted + (num_accepted < num_proposed)
        self.tested = DECAY * self.tested + tested
        self.accepted = DECAY * self.accepted + num_accepted

    def num_proposals(self, k: int, threshold: float) -> int:
        """How many tokens to propose now (at most k); 0 while backing off. Call once per proposal chance."""
        rate = self.rate
        if threshold <= 0 or rate is None:
            return k
        n = 0
        while n < k and rate ** (n + 1) >= threshold:
            n += 1
        if n:
            self.backoff = self.num_skipped = 0
            return n
        self.backoff = self.backoff or BACKOFF_STEPS
        if self.num_skipped < self.backoff:
            self.num_skipped += 1
            return 0
        self.backoff, self.num_skipped = min(2 * self.backoff, MAX_BACKOFF_STEPS), 0  # probe; if it fails: wait longer
        return 1
