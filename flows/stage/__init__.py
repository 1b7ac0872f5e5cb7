"""One stage, flow side: the Prefect task (`task`), one supervised launch (`supervise`), its
command line, environment and the run's device state (`launch`), the engines that start it
(`launchers/`), its log and progress (`output`, following its records with `jsonl_tail`), its
processes (`procs`), the hang watch (`hang`), and why it failed, in one line (`failures`, with
the first rank to die from `rank_exit`)."""
