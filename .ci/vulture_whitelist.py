"""Names vulture cannot see used (``vulture src .ci/vulture_whitelist.py``), each with why."""

# ruff: noqa
_ = object()

# anywidget traits: synced to the browser, read by dashboard.js
header
_.header
# ipykernel's display publisher method, replaced for the length of one display
_._flush_streams
# a render counter the tests read (throttling is asserted on it)
_.renders
# IPython calls it to show a CellFailed / CellInterrupted without a Python traceback
_._render_traceback_
# the fork server's entry point, started as `python -c "... _serve_forks(...)"`
_serve_forks
# imported once in the fork server so that every rank forked from it has it
IPython
# %ddp subcommands, dispatched as getattr(self, f"_{command}")
_._start
_._status
_._stacks
_._restart
_._interrupt
_._push
_._pull
_._export
_._debug
_._run
_._attach
_._copy
_._rollback
_._connect
_._list
_._disconnect
# matplotlib's backend protocol (MPLBACKEND=module://nbddp.rank.mpl_backend)
FigureCanvas
FigureManager
# registered with atexit by its decorator
_stop_all_pools
# public API: Pool.pids, Pool.execute
_.pids
_.execute
# file objects have a mode; loggers and libraries read it from sys.stdout
_.mode
# pdb reads its commands with stdin.readline() (nbddp.rank.debugger.Remote is its stdin)
_.readline
# torch's counter of unnamed groups: reset before a join, as destroying WORLD resets it
_.group_count
# pickle.Unpickler calls it
_.find_class
# tests forge frames with a channel's own key
_._out_key
# the frameworks call them: a module's __getattr__, Lightning's Logger API, accelerate's
# GeneralTracker attributes
__getattr__
_.experiment
_.log_hyperparams
_.requires_logging_directory
_.main_process_only
# ast.NodeVisitor calls visit_<node class> (nbddp.pool.rerun)
_.visit_MatchStar
