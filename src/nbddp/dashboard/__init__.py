"""How a cell is shown: the sinks (the live widget and its JS, plain text), folded output,
the metric charts and the notebook's record of ``log_metrics``. A sink renders events;
it never steers the pool."""
