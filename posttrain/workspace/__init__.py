"""The workspace's own records: runs and their status, the champion registry, what `clean` may delete
and its trash."""
