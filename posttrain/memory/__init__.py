"""Memory pre-flight: estimate a training stage's per-device memory before it loads anything.

`estimate.py` is pure arithmetic on model and recipe numbers (no torch); `preflight.py` reads
the recipe, the base's config.json and the device's free memory, and refuses a stage that
cannot fit, naming the numbers and the changes that would make it fit (`fixes.py`: each change
with its own estimate).
"""
