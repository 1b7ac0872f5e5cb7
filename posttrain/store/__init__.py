"""The artifact store: stage folders, manifests written last, one writer per folder (`locking`),
whether an artifact is complete and may be reused (`status`), and values computed once and
reused across runs (`cache`)."""
