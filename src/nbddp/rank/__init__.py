"""One rank: the worker process (``python -m nbddp.worker``) and its parts (control
channel, process group keeper, cell runner), and what a cell calls on a rank
(``log_metrics``, ``progress``, collectives, the workspace). It knows nothing of the
notebook's side but the wire."""
