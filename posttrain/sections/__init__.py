"""The recipe's building blocks, below the stage kinds that use them: the section base and its
field declarations (`fields`: `Result`, `Execution`), the blocks kinds share (`shared`), the
`infra` section with its `slurm` and `kubernetes` parts, the `run` section, and a reward
function's entry (`rewards`). The recipe they add up to is `posttrain.config.schema`."""
