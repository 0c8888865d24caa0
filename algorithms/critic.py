"""The ``gae`` credit's critic: a value head on the policy's last hidden state.

:class:`Critic` predicts, from the hidden state before a policy turn (the one that
turn's first token is sampled from, :func:`~algorithms.logprobs.hidden_before`), the
return from that turn on. GRPO computes those hidden states once per step, with the
policy's pre-update weights and no gradient (or, with ``critic_input="sampler"``, takes
the ones the sampler recorded, ``Episode.turn_hidden``), and:

* the critic's values give each turn's GAE advantage
  (:func:`~algorithms.losses.gae_advantages`);
* the critic then fits the turns' lambda-returns on the same hidden states, with its own
  AdamW (``GRPOConfig.value_lr``) for ``value_epochs`` full-batch steps.

The hidden states carry no gradient, so the value loss trains the head alone: the
policy (its LoRA adapter or, with full fine-tuning, its weights) learns from the policy
loss only, and the head gets no gradient from the policy loss (TRL's value head on a
shared trunk trades one against the other with ``vf_coef``; a separate input keeps the
policy's update exactly GRPO's). The head is a layer norm without parameters and a
linear layer initialised to zero: it predicts 0 until it has seen returns, so the first
steps' advantages are the returns themselves (whitened over the batch).

It is saved in checkpoints (``critic.pt``: weights and optimizer state) and resumed
with them; ``agentenv export`` leaves it out (the policy alone generates).
"""

from __future__ import annotations

from typing import Any

import torch


class ValueHead(torch.nn.Module):
    """``hidden (M, H) -> value (M,)``: layer norm (no parameters), then a linear layer
    initialised to zero (float32 whatever the policy's dtype)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, elementwise_affine=False)
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(hidden.float())).squeeze(-1)


class Critic:
    """A :class:`ValueHead` and its optimizer: ``values(hidden)``, ``fit(hidden, targets)``."""

    def __init__(
        self, hidden_size: int, lr: float, max_grad_norm: float, device: torch.device | str
    ) -> None:
        self.head = ValueHead(hidden_size).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The values ``(M,)`` of hidden states ``(M, H)``, without gradient."""
        return self.head(hidden.to(self.head.linear.weight.device))

    def fit(self, hidden: torch.Tensor, targets: torch.Tensor, epochs: int) -> dict[str, float]:
        """``epochs`` AdamW steps on ``0.5 * mean((V(hidden) - targets)^2)`` over the whole
        batch ``(M, H)`` / ``(M,)``. Returns ``critic/value_loss`` (before the first step),
        ``critic/value_loss_after`` and ``critic/explained_variance`` (of the values the
        advantages used: ``1 - Var(targets - V) / Var(targets)``; 1 is perfect, 0 no
        better than a constant)."""
        if not targets.numel():
            return {}
        device = self.head.linear.weight.device
        hidden, targets = hidden.to(device), targets.to(device, torch.float32)
        before = self.values(hidden)
        var = targets.var(correction=0).item()
        explained = 1 - (targets - before).var(correction=0).item() / var if var > 0 else 0.0
        loss_before = 0.5 * (before - targets).square().mean().item()
        for _ in range(epochs):
            self.optimizer.zero_grad(set_to_none=True)
            loss = 0.5 * (self.head(hidden) - targets).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.max_grad_norm)
            self.optimizer.step()
        after = 0.5 * (self.values(hidden) - targets).square().mean().item()
        return {
            "critic/value_loss": loss_before,
            "critic/value_loss_after": after,
            "critic/explained_variance": explained,
            "critic/value_mean": before.mean().item(),
            "critic/target_mean": targets.mean().item(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
