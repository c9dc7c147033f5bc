"""The tools (layer L5): the ``weightcache`` command, ``weightcache doctor``, the benchmarks and the engine-parity
runner.

They use the library as its users do, through its public API (``import weightcache as wc``,
:class:`weightcache.client.KeeperConnection` for the keeper commands); nothing in the library imports them.
"""
