"""`dflash-pipe bench`: measurements a user runs on their own machine, each beside its baseline."""

from dflash_pipe.bench.result import BenchResult

__all__ = ["BenchResult"]
