"""A training stage's per-device memory, estimated before it loads anything.

`estimate.py` is pure arithmetic on model and recipe numbers (no torch); the kinds declare their
shape with it. `fixes.py` names the changes that would make a stage fit, each with its own
estimate. The pre-flight that reads the recipe, the base's config.json and the device's free
memory and refuses a stage that cannot fit is `posttrain.runtime.preflight`: it reads the kinds,
which read this package.
"""
