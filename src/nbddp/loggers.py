"""Charts from the frameworks that log already: Lightning's ``self.log`` and accelerate's
``accelerator.log`` reach :func:`nbddp.log_metrics`, on every rank.

:class:`LightningLogger` is a Lightning logger (``Trainer(logger=...)``,
``Fabric(loggers=...)``), :class:`AccelerateTracker` an accelerate tracker
(``Accelerator(log_with=...)``). The frameworks' own log on rank 0 only; these on every
rank: a line per rank is the point. Each class is built on first use (from
``lightning.pytorch``, else ``pytorch_lightning``; ``accelerate``), so nbddp imports
without them. What is not one number (a string, None, a tensor of many elements) is
skipped; a nested dict is flattened as ``outer/inner``.

accelerate (as of 1.15) runs ``Accelerator.init_trackers`` and ``.log`` on the main process
only, whatever a tracker's ``main_process_only`` says: building :class:`AccelerateTracker`
wraps both, once per process, so that on the other processes they do the same for nbddp's
trackers, and only for them (other trackers stay on the main process).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from .rank.metrics import log_metrics

__all__ = ["AccelerateTracker", "LightningLogger"]  # noqa: F822 (built by __getattr__)


def __getattr__(name: str) -> type:
    build = {"LightningLogger": _lightning, "AccelerateTracker": _accelerate}.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = build()
    cls.__module__, cls.__qualname__ = __name__, name  # pickled by reference, like any class
    return cls


def _numbers(values: Mapping, prefix: str = "") -> dict[str, float]:
    """The numbers in ``values``, nested dicts flattened as ``outer/inner``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_numbers(value, f"{name}/"))
        elif value is not None and not isinstance(value, (str, bytes)):
            try:
                out[name] = float(value)
            except (TypeError, ValueError, RuntimeError):
                pass  # not one number: an image, a list, a tensor of many elements
    return out


def _lightning() -> type:
    try:
        from lightning.pytorch.loggers import Logger
    except ImportError:
        from pytorch_lightning.loggers import Logger

    class LightningLogger(Logger):
        """``Trainer(logger=LightningLogger())``: ``self.log(...)`` draws a chart per metric,
        a line per rank (not ``@rank_zero_only``). ``run`` goes to ``log_metrics``. The
        ``epoch`` Lightning adds to each step's metrics is dropped unless ``epoch=True``."""

        def __init__(self, run: str | None = None, *, epoch: bool = False) -> None:
            super().__init__()
            self.run, self.epoch, self.hyperparams = run, epoch, {}  # hparams: kept, not drawn

        @property
        def name(self) -> str:
            return "nbddp"

        @property
        def version(self) -> str | int:  # checkpoints: ROOT/nbddp/{run or version_0}/
            return self.run if self.run is not None else 0

        @property
        def experiment(self) -> LightningLogger:  # self.logger.experiment.log_metrics(...)
            return self

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            self.hyperparams.update(params if isinstance(params, Mapping) else vars(params))

        def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
            values = _numbers(metrics)
            if not self.epoch:
                values.pop("epoch", None)  # Lightning's own: a staircase chart per rank
            if values:
                log_metrics(values, step, run=self.run)

    return LightningLogger


def _accelerate() -> type:
    from accelerate.tracking import GeneralTracker

    class AccelerateTracker(GeneralTracker):
        """``Accelerator(log_with=AccelerateTracker())``: ``accelerator.log(...)`` draws a
        chart per metric, a line per process. ``run`` goes to ``log_metrics``."""

        name = "nbddp"
        requires_logging_directory = False
        main_process_only = False

        def __init__(self, run: str | None = None) -> None:
            super().__init__()
            self.run, self.config = run, {}  # init_trackers(config=...): kept, not drawn

        @property
        def tracker(self) -> AccelerateTracker:
            return self

        def store_init_configuration(self, values: dict) -> None:
            self.config.update(values)

        def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
            if numbers := _numbers(values):
                log_metrics(numbers, step, run=self.run)

    _on_every_process(AccelerateTracker)
    return AccelerateTracker


def _on_every_process(ours: type) -> None:
    """Wrap ``Accelerator.init_trackers`` and ``.log``: where accelerate ran nothing (not the
    main process), they start and log the ``ours`` trackers (see the module's docstring)."""
    from accelerate import Accelerator

    init_trackers, log = Accelerator.init_trackers, Accelerator.log

    def mine(accelerator, trackers) -> list:  # none on the main process: accelerate did it all
        return [] if accelerator.is_main_process else [t for t in trackers if isinstance(t, ours)]

    @functools.wraps(init_trackers)
    def init_everywhere(self, project_name, config=None, init_kwargs=None):
        init_trackers(self, project_name, config, init_kwargs)
        for tracker in mine(self, self.log_with):
            if tracker not in self.trackers:
                self.trackers.append(tracker)
                tracker.start()
                if config is not None:
                    tracker.store_init_configuration(config)

    @functools.wraps(log)
    def log_everywhere(self, values, step=None, log_kwargs=None):
        log(self, values, step, log_kwargs)
        for tracker in mine(self, self.trackers):
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    Accelerator.init_trackers, Accelerator.log = init_everywhere, log_everywhere
