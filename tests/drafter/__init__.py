"""Drafter tests (a package so helper imports and module names stay unambiguous)."""
