"""The warm process: a long-lived, pre-imported, CUDA-free process that forks each start of an engine, so that a
restart does not pay for its imports.

- :mod:`~weightcache.warm.target`: what a command line runs, and what to preload for it;
- :mod:`~weightcache.warm.identity`: which warm process serves it (slot) and whether it is current (key);
- :mod:`~weightcache.warm.server`: the warm process (``weightcache warm serve``, which the launcher spawns);
- :mod:`~weightcache.warm.child`: the forked child becoming the command;
- :mod:`~weightcache.warm.launcher`: ``weightcache run -- CMD``;
- :mod:`~weightcache.warm.spawn`: multiprocessing's spawn through the warm process.

It is not the keeper and shares nothing with it but the socket directory's parent and the wire framing: the keeper
never imports torch; a warm process imports whatever its commands need. Imported by the CLI's ``run`` and
``warm`` commands only. See docs/guides/warm.md.
"""
