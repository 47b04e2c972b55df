"""The one algorithm class behind every registered name (no hooks here).

:class:`PolicyGradient` implements :class:`skyrl_host.interfaces.Algorithm` from a
config made by :func:`skyrl_algorithms._config.make_config`; the registered
modules subclass it only to bind their config class. numpy and torch are imported
inside the methods, so importing a registered module stays light.
"""

from __future__ import annotations

from typing import Any, Mapping


class PolicyGradient:
    """Group-relative policy gradient: reward shaping, dynamic sampling,
    advantages and the clipped policy loss, all set by ``config``."""

    config_class: type | None = None  # set by each registered algorithm

    def __init__(self, config: Any = None):
        if config is None:
            if self.config_class is None:
                raise TypeError(f"{type(self).__name__} needs a config")
            config = self.config_class()
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # -- what the driver and the backend read --------------------------------

    @property
    def needs_reference(self) -> bool:
        """True when a KL term is configured (in the loss or in the reward)."""
        return self.config.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """True when the KL penalty goes into the rewards (the RewardKL capability)."""
        return self.needs_reference and bool(self.config.kl_in_reward)

    @property
    def off_policy(self) -> str:
        """The off-policy correction the loss applies against the engine's logprobs:
        'none', 'tis', 'mis', 'icepop' or 'decoupled' (``tis_cap > 0`` reads 'tis')."""
        c = self.config
        if c.decoupled:
            return "decoupled"
        return "tis" if c.tis_cap > 0 else c.off_policy

    @property
    def dynamic_sampling(self) -> bool:
        return bool(self.config.dynamic_sampling)

    @property
    def max_refill_rounds(self) -> int:
        return int(self.config.max_refill_rounds)

    # -- rewards --------------------------------------------------------------

    def overlong_buffer(self, max_new_tokens: int) -> int:
        """The overlong buffer in tokens for this job: the configured one, or
        ``max_new_tokens // 5`` (at least 1); never more than ``max_new_tokens``."""
        buffer = self.config.overlong_buffer
        if buffer is None:
            buffer = max(1, max_new_tokens // 5)
        return min(int(buffer), int(max_new_tokens))

    def shape_rewards(self, batch: Any, max_new_tokens: int) -> Any:
        """float32 [S]: ``batch.rewards`` plus the overlong penalty when
        ``overlong_shaping`` is on (the response length is every token after the
        prompt)."""
        import numpy as np

        from skyrl_algorithms._advantages import overlong_penalty

        rewards = np.asarray(batch.rewards, dtype=np.float32)
        if np.isnan(rewards).any():
            raise ValueError("batch.rewards contain NaN: score every sequence before shaping rewards")
        if not self.config.overlong_shaping:
            return rewards.copy()
        penalty = overlong_penalty(
            batch.response_lens, max_new_tokens, self.overlong_buffer(max_new_tokens), self.config.overlong_penalty
        )
        return (rewards + penalty).astype(np.float32)

    def kl_reward_penalty(self, batch: Any, ref_logprobs: Any) -> Any:
        """float32 [S]: what to subtract from the rewards for ``kl_in_reward``:
        ``kl_coef`` times each sequence's KL estimate (engine logprobs against
        ``ref_logprobs``, float32 [T] aligned with the batch) summed over its loss
        tokens; zeros when ``kl_in_reward`` is off or ``kl_coef`` is 0."""
        import numpy as np

        from skyrl_algorithms._advantages import kl_reward_penalty

        if not (self.config.kl_in_reward and self.config.kl_coef > 0):
            return np.zeros(batch.n_sequences, dtype=np.float32)
        kl = kl_reward_penalty(
            batch.logprobs, ref_logprobs, batch.loss_mask, batch.seq_ids(), self.config.kl_estimator, batch.n_sequences
        )
        return (self.config.kl_coef * kl).astype(np.float32)

    def keep(self, batch: Any, rewards: Any) -> Any:
        """bool [S]: with ``dynamic_sampling``, False for every sequence of a group
        whose ``rewards`` are all equal; otherwise all True."""
        import numpy as np

        from skyrl_algorithms._advantages import keep_groups_with_spread

        if not self.config.dynamic_sampling:
            return np.ones(batch.n_sequences, dtype=bool)
        return keep_groups_with_spread(rewards, batch.group_ids)

    def sequence_advantages(self, batch: Any, rewards: Any) -> Any:
        """float32 [S]: one advantage per sequence (see :func:`group_advantages`)."""
        from skyrl_algorithms._advantages import group_advantages

        c = self.config
        return group_advantages(
            rewards, batch.group_ids, baseline=c.baseline, scale_by_std=c.scale_by_std, std=c.std, eps=c.eps
        )

    def advantages(self, batch: Any, rewards: Any) -> Any:
        """float32 [T]: each sequence's advantage on its loss tokens, 0 elsewhere."""
        from skyrl_algorithms._advantages import token_advantages

        return token_advantages(batch, self.sequence_advantages(batch, rewards))

    # -- the loss -------------------------------------------------------------

    def loss(self, inputs: Any) -> tuple[Any, Mapping[str, Any]]:
        """This micro-batch's share of the step loss and its metrics (see
        :func:`skyrl_algorithms._losses.policy_loss`)."""
        from skyrl_algorithms._losses import policy_loss

        c = self.config
        return policy_loss(
            inputs,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip_c=c.dual_clip_c,
            ratio_level=c.ratio_level,
            loss_agg=c.loss_agg,
            kl_coef=c.kl_coef,
            kl_estimator=c.kl_estimator,
            kl_in_loss=not c.kl_in_reward,
            tis_cap=c.tis_cap,
            off_policy=c.off_policy,
            off_policy_level=c.off_policy_level,
            off_policy_cap=c.off_policy_cap,
            icepop_beta=c.icepop_beta,
            icepop_alpha=c.icepop_alpha,
            decoupled=c.decoupled,
            teacher_kl_coef=c.teacher_kl_coef,
            teacher_kl_estimator=c.teacher_kl_estimator,
            teacher_kl_topk=c.teacher_kl_topk,
        )


def declared_traits(config: Any) -> Any:
    """The traits every algorithm declares (``register(..., traits=declared_traits)``):
    it needs a ``[teacher]`` when its config adds the teacher KL to the loss."""
    from skyrl_host.interfaces import AlgorithmTraits

    uses = config.teacher_kl_coef > 0
    return AlgorithmTraits(teacher=uses, teacher_topk=config.teacher_kl_topk if uses else 0)
