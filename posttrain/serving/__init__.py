"""A model behind an OpenAI-compatible server: vLLM, SGLang or `transformers serve`, started
by a stage (or found at a URL), fed each policy version, and stopped. Rollouts sample from it
(`rollout.engine: server`) and judges score with it (`posttrain.rewards.judge`). See `server`
(a rollout server's life), `api` (requests and answers), `weights` (the version folders),
`process` and `keeper` (the process), `client` (HTTP with bounded waits)."""
