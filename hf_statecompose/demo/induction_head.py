"""The induction-head (IH) task of the COFFEE paper (arXiv 2510.14027, App. E), generated on demand.

Symbols ``V = {1, ..., vocab}`` (the paper: 7), ``0`` is the padding symbol, so the model vocabulary is
``|M| = vocab + 1`` (8). A sequence of ``seq_len`` symbols is (App. E, eq. (19))::

    noise1 ‖ trigger ‖ target ‖ noise2 ‖ trigger ‖ 0 ... 0                 (noise_between = 0)
    noise1 ‖ trigger ‖ noise  ‖ target ‖ noise2 ‖ trigger ‖ 0 ... 0        (the Table 3 variant, L_noise > 0)

* ``seq_len`` counts everything, the ``target_len - 1`` padding zeros of Remark 5 included, so the model
  always sees ``seq_len`` symbols; the noise fills the rest: ``seq_len - 2 L_tri - 2 L_tar + 1 - L_noise``
  symbols (at least 1), split between noise1 and noise2 at a uniform random point (the position of the
  first trigger is uniform);
* the trigger is fixed for the task (Remark 4): given, or drawn once from ``trigger_seed``;
* every symbol of the noise and the target is uniform over V, and a sequence in which the trigger does not
  occur exactly twice (once at each of its two places) is drawn again (App. E: "discarding sequences in
  which at least one of the target and the noise subsequences contains the trigger"); for ``L_tri = 1``
  that means noise and target symbols are uniform over ``V \\ {trigger}``, drawn so directly;
* the label: the target, predicted at the last ``L_tar`` positions (the last trigger symbol predicts the
  first target symbol, each padding zero the next one); ``labels`` is ``-100`` elsewhere.

:meth:`InductionHeadTask.sample` is vectorised over the batch (512 sequences of 16 in well under a
millisecond plus the rejection of the rare bad rows); a seeded ``torch.Generator`` makes it deterministic.
Training and validation use two independent generators (App. H.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAD = 0
IGNORE = -100


@dataclass
class InductionHeadTask:
    """The IH task: ``seq_len``, ``trigger_len``, ``target_len``, ``noise_between`` (L_noise, Table 3),
    ``vocab`` (|V|), ``trigger`` (fixed; drawn from ``trigger_seed`` when not given)."""

    seq_len: int = 16
    trigger_len: int = 1
    target_len: int = 1
    noise_between: int = 0
    vocab: int = 7
    trigger: tuple[int, ...] | None = None
    trigger_seed: int = 0
    _trigger: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if min(self.trigger_len, self.target_len, self.vocab) < 1 or self.noise_between < 0:
            raise ValueError("trigger_len, target_len and vocab must be >= 1 and noise_between >= 0")
        if self.noise_len < 1:
            raise ValueError(
                f"seq_len {self.seq_len} leaves no noise for trigger_len {self.trigger_len}, "
                f"target_len {self.target_len}, noise_between {self.noise_between} "
                f"(App. E: L_seq - 2 L_tri - L_tar >= 1, plus the padding and L_noise)"
            )
        if self.trigger is None:
            g = torch.Generator().manual_seed(self.trigger_seed)
            self.trigger = tuple(int(s) for s in torch.randint(1, self.vocab + 1, (self.trigger_len,), generator=g))
        self.trigger = tuple(int(s) for s in self.trigger)
        if len(self.trigger) != self.trigger_len or not all(1 <= s <= self.vocab for s in self.trigger):
            raise ValueError(f"trigger must be {self.trigger_len} symbols in 1..{self.vocab}, got {self.trigger}")
        self._trigger = torch.tensor(self.trigger, dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        """|M| = |V| + 1 (the padding symbol 0)."""
        return self.vocab + 1

    @property
    def padding(self) -> int:
        return self.target_len - 1

    @property
    def noise_len(self) -> int:
        """Noise symbols outside the trigger-target block (noise1 + noise2)."""
        return self.seq_len - 2 * self.trigger_len - self.target_len - self.padding - self.noise_between

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "trigger_len": self.trigger_len,
            "target_len": self.target_len,
            "noise_between": self.noise_between,
            "vocab": self.vocab,
            "trigger": self._trigger.tolist(),
            "pad": PAD,
        }

    def _draw(self, batch: int, generator: torch.Generator):
        """Symbols for the noise (both sides), the L_noise block and the target: [batch, ...] each."""
        total = self.noise_len + self.noise_between + self.target_len
        if self.trigger_len == 1:  # uniform over V \ {trigger}: shift the symbols at or above the trigger
            draw = torch.randint(1, self.vocab, (batch, total), generator=generator)
            draw = draw + (draw >= self._trigger[0]).long()
        else:
            draw = torch.randint(1, self.vocab + 1, (batch, total), generator=generator)
        noise, between, target = draw.split([self.noise_len, self.noise_between, self.target_len], dim=1)
        split = torch.randint(0, self.noise_len + 1, (batch,), generator=generator)  # length of noise1
        return noise, between, target, split

    def _assemble(self, noise, between, target, split):
        batch = noise.shape[0]
        trig = self._trigger.expand(batch, -1)
        block = torch.cat([trig, between, target], dim=1)  # the first trigger, L_noise, the target
        head_len = self.noise_len + block.shape[1]
        t = torch.arange(head_len).expand(batch, -1)
        rel = t - split[:, None]
        in_block = (rel >= 0) & (rel < block.shape[1])
        noise_idx = torch.where(rel < 0, t, t - block.shape[1]).clamp(0, max(self.noise_len - 1, 0))
        head = torch.where(in_block, block.gather(1, rel.clamp(0, block.shape[1] - 1)), noise.gather(1, noise_idx))
        pad = torch.full((batch, self.padding), PAD, dtype=torch.long)
        return torch.cat([head, trig, pad], dim=1)

    def trigger_counts(self, input_ids: torch.Tensor) -> torch.Tensor:
        """How often the trigger occurs in each row, [batch]."""
        windows = input_ids.unfold(1, self.trigger_len, 1)  # [batch, L - L_tri + 1, L_tri]
        return (windows == self._trigger).all(-1).sum(-1)

    def sample(self, batch: int, generator: torch.Generator) -> dict:
        """``{"input_ids" [B, L], "labels" [B, L] (-100 but at the last L_tar positions), "target" [B, L_tar],
        "split" [B] (length of noise1)}``, long tensors."""
        noise, between, target, split = self._draw(batch, generator)
        ids = self._assemble(noise, between, target, split)
        if self.trigger_len > 1:  # reject and redraw rows where the trigger occurs more than twice
            for _ in range(1000):
                bad = (self.trigger_counts(ids) != 2).nonzero().flatten()
                if bad.numel() == 0:
                    break
                n2, b2, t2, s2 = self._draw(bad.numel(), generator)
                noise[bad], between[bad], target[bad], split[bad] = n2, b2, t2, s2
                ids[bad] = self._assemble(n2, b2, t2, s2)
            else:  # pragma: no cover - needs a pathological trigger
                raise RuntimeError(f"could not draw sequences with the trigger {self.trigger} exactly twice")
        labels = torch.full_like(ids, IGNORE)
        labels[:, self.seq_len - self.target_len :] = target
        return {"input_ids": ids, "labels": labels, "target": target, "split": split}


def target_logits(logits: torch.Tensor, target_len: int) -> torch.Tensor:
    """The logits at the target positions (the last ``target_len``): [B, L, V] -> [B, target_len, V]."""
    return logits[:, logits.shape[1] - target_len :]


def score(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) of the target predictions; ``logits`` [B, L, V], ``target`` [B, L_tar].
    Accuracy counts a symbol as right when the argmax is the target symbol (per symbol, as the paper's
    Predictions array, App. F)."""
    tl = target_logits(logits, target.shape[1])
    loss = torch.nn.functional.cross_entropy(tl.reshape(-1, tl.shape[-1]).float(), target.reshape(-1))
    acc = (tl.argmax(-1) == target).float().mean()
    return loss, acc


__all__ = ["IGNORE", "PAD", "InductionHeadTask", "score", "target_logits"]
