"""The artifact store: stage folders, manifests written last, one writer per folder (`locking`),
whether an artifact is complete and may be reused (`status`), values computed once and reused
across runs (`cache`), and the look under the lock that says whether a stage must run
(`claim`)."""
