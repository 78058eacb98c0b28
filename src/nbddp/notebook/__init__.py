"""The notebook's front end: ``%%ddp``/``%ddp`` and ``nbddp.ranch``, their options, which
pool a notebook uses, what is said around a cell, ``%ddp attach``/``detach`` and export.
It knows no sockets: it asks the pool (:mod:`nbddp.pool`) and shows what comes back
through a sink (:mod:`nbddp.dashboard`)."""
