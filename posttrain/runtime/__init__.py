"""What surrounds a stage process: what its `run` is given (`context`), its spec (`spec`), its
verdicts (`errors`, `diskspace`), the memory pre-flight before anything loads (`preflight`), the
watch on its supervisor (`orphan`), what an earlier attempt left (`recovery`), the host-wide
device lock a run takes before launching any (`device_lock`), and its end without a last
garbage collection (`exit`, the CLI's too)."""
