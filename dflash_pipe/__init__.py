"""dflash-pipe: train DFlash speculative-decoding drafters online from a streaming target."""

__version__ = "0.1.0"
