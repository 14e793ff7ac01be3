"""The worker process: ``proc`` (``dflash-pipe worker``: handshake, drafter build, group join, resume),
``link`` (the IO thread that owns the DEALER socket), ``loop`` (the training loop: vote, step, share, ACK)
and ``threads`` (several drafters as threads of one process). The training step's parts it drives live in
``dflash_pipe.train``; it shares only ``wire`` and ``run`` with the producer."""
