"""Online RL: the loop every online kind runs (`loop`) and each kind's step (`online_rl`: PPO
and the GRPO family; `online_dpo`; `distill`), the algorithm registry (`algorithms`), setup,
rollouts and their engines (`rollout`, `serving`), the reward, the losses, the updates,
held-out evaluation and the step's metrics record."""
