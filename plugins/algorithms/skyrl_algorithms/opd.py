"""opd: on-policy distillation (the student samples, a teacher scores every sampled token).

Each generated token's advantage is the per-token reverse KL signal
``teacher_coef * (log p_teacher(token) - log p_student(token))``: the teacher's logprob of
the token the student chose (the ``teacher_logprobs`` side channel the rl driver fills
from ``[teacher]``) minus the student's, as the engine sampled it (its logprobs also weigh
the importance ratio of the clipped loss). A token the teacher finds likelier than the
student is pushed up, one it finds less likely down: every token gets a signal, where a
reward gives one per sequence. ``reward_weight`` adds GRPO's group-relative reward
advantage on top (0: pure distillation). PPO-clip 0.2 / 0.2, token-mean loss.
"""

from __future__ import annotations

from typing import Any

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import UserError
from skyrl_host.interfaces import AlgorithmTraits
from skyrl_host.options import ge, option
from skyrl_algorithms._algorithm import PolicyGradient, declared_traits
from skyrl_algorithms._config import make_config

_OpdBase = make_config(
    "_OpdBase",
    __name__,
    """The policy-gradient options opd shares.""",
    clip_low=0.2,
    clip_high=0.2,
    loss_agg="token-mean",
)


@attrs.frozen
class OpdConfig(_OpdBase):  # type: ignore[misc, valid-type]
    """Options of ``[algorithm]`` when ``name = "opd"``."""

    teacher_coef: float = option(1.0, help="the scale of the per-token teacher signal", validator=ge(0))
    reward_weight: float = option(0.0, help="how much of GRPO's reward advantage to add (0: distillation alone)",
                                  validator=ge(0))


class Opd(PolicyGradient):
    """The algorithm (a :class:`skyrl_host.interfaces.Algorithm`)."""

    config_class = OpdConfig

    def advantages(self, batch: Any, rewards: Any) -> Any:
        import numpy as np

        teacher = batch.side_channels.get("teacher_logprobs")
        if teacher is None:
            raise UserError("[algorithm] name = \"opd\": the batch holds no teacher logprobs; add a [teacher] table")
        mask = batch.loss_mask != 0
        signal = np.where(mask, np.asarray(teacher, dtype=np.float32) - batch.logprobs, 0.0)
        out = (self.config.teacher_coef * signal).astype(np.float32)
        if self.config.reward_weight > 0:
            out += self.config.reward_weight * np.where(mask, super().advantages(batch, rewards), 0.0)
        return out.astype(np.float32)


@hookimpl
def skyrl_register_algorithms(register: Any) -> None:
    register(
        "opd",
        Opd,
        config=OpdConfig,
        description="On-policy distillation: the per-token reverse KL to a [teacher] is the advantage; PPO-clip",
        # Always a [teacher]; its top-k too when the teacher KL term asks for it (declared_traits).
        traits=lambda config: AlgorithmTraits(teacher=True, teacher_topk=declared_traits(config).teacher_topk),
    )
