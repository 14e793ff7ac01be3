"""Run formats: what the producer and the workers both read and write in a run dir.

``config`` (the one ``RunConfig``, saved as RUN_DIR/config.json), ``layout`` (which devices run what),
``config_file`` (a ``--config`` file to the same fields), ``checkpoint`` (RUN_DIR/checkpoints/step-N/),
``manifest`` (the sizes and sha256 a checkpoint or an export carries, file modes from the umask),
``ledger`` (which samples a checkpoint's weights were trained on) and ``record`` (RUN_DIR/producer.json,
how a worker finds the producer). Both sides import these; they import nothing of the processes.
"""
