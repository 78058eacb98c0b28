"""The pool core: :class:`~nbddp.pool.facade.Pool` and what it is made of: the rank
processes, the hub that reads every connection, the roster, one cell from its ``Run`` to
its ``CellEnd``, its supervision, and recovery. No IPython, no sink: it runs in the
kernel, or in a process of its own (:mod:`nbddp.detached`)."""
