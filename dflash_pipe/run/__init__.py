"""Run formats and the run directory: what the producer and the workers both read and write in a run dir.

``dir`` (``RunDir``: every path of a run dir, its lock, its saved config, the launch's checks of it),
``files`` (the run dir's names and ``RunDirError``), ``lock`` (one launch per run dir), ``resume`` (what a
resume checks first), ``locate`` (which checkpoint ``export`` reads and a resume starts from), ``config``
(the one ``RunConfig``), ``layout`` (which devices run what), ``config_file`` (a ``--config`` file to the
same fields), ``checkpoint`` (RUN_DIR/checkpoints/step-N/), ``manifest`` (the sizes and sha256 a checkpoint
or an export carries, file modes from the umask), ``ledger`` (which samples a checkpoint's weights were
trained on) and ``record`` (how a worker finds the producer). Both sides import these; they import nothing
of the processes.
"""
