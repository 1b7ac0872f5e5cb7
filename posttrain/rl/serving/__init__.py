"""Rollouts from a serving engine (`rollout.engine: server`): vLLM, SGLang or any
OpenAI-compatible server that the RL stage starts (or finds), feeds each policy version, and
stops. See `server` (its life), `api` (requests and answers), `weights` (the version folders),
`engine` (the `RolloutEngine` over it)."""
