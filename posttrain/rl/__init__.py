"""Online RL: the loop every online kind runs (`loop`) and each kind's step (`update`: PPO and
the GRPO family's clipped update; `online_dpo`; `distill`), the algorithm registry
(`algorithms`), setup, rollouts and their engines (`rollout`, `serving`), the reward, the
losses, held-out evaluation and the step's metrics record."""
