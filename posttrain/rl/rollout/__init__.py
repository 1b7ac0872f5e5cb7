"""Rollouts: the engines that sample (in process, `engine`; a rollout server, `server_engine`
over `posttrain.serving`), one step's rollout collected and scored (`collect`, `sample`),
multi-turn episodes as rollouts (`multiturn`), and generating one step ahead (`offpolicy`)."""
