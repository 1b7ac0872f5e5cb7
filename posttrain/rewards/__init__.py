"""Reward functions for online RL: verifiers the recipe names (`rewards:`), scored on each
rollout beside (or instead of) a learned reward model.

The contract is TRL's `reward_funcs`, so functions written for TRL work here unchanged:

    fn(prompts, completions, **kwargs) -> list[float | None]

- `prompts[i]`: the conversation before the reply (a list of chat messages);
- `completions[i]`: `[{"role": "assistant", "content": text}]`;
- kwargs: the prompt row's other columns (`answer`, `task`, ...), each a list aligned with the
  rows, plus `completion_ids` (the response's token ids, stop token included when it stopped)
  and `stopped` (the response ended with a stop token before max_new_tokens);
- returns one finite float per row; None = not applicable to that row.

`spec` is the recipe entry, `loader` finds and imports a function (and says which code it ran),
`combine` calls them and checks what they return. The other modules are the built-in verifiers.
"""
