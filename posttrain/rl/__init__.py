"""The steps of the online RL stage (`posttrain.stages.online_rl`, run by PPO and the GRPO
family): setup, rollouts (generate and score), advantages and the update, held-out evaluation,
and the step's metrics record."""
