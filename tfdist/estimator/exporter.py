"""Exporters: SavedModels written by `train_and_evaluate` after evaluations."""

from __future__ import annotations

import os
import shutil
from typing import Callable


class Exporter:
    """Base of the exporters an `EvalSpec` takes; `export` is called after each evaluation."""

    def __init__(self, name: str, serving_input_receiver_fn: Callable):
        if not isinstance(name, str) or not name:
            raise ValueError(f"Exporter argument 'name' must be a non-empty string. Received: name={name!r}")
        self.name = name
        self.serving_input_receiver_fn = serving_input_receiver_fn

    def export(self, estimator, export_path: str, checkpoint_path: str, eval_result: dict,
               is_the_final_export: bool) -> str | None:
        raise NotImplementedError


class FinalExporter(Exporter):
    """Exports a SavedModel once, after the final evaluation.

    Args:
        name: str. Exports go to `model_dir/export/<name>/<timestamp>`.
        serving_input_receiver_fn: as for `Estimator.export_saved_model`.

    Example:

    ```python
    eval_spec = EvalSpec(eval_input_fn, exporters=[FinalExporter("digits", serving_fn)])
    ```
    """

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        if not is_the_final_export:
            return None
        return estimator.export_saved_model(export_path, self.serving_input_receiver_fn,
                                            checkpoint_path=checkpoint_path)


class LatestExporter(Exporter):
    """Exports a SavedModel after every evaluation, keeping the newest `exports_to_keep`.

    Args:
        name: str. Exports go to `model_dir/export/<name>/<timestamp>`.
        serving_input_receiver_fn: as for `Estimator.export_saved_model`.
        exports_to_keep: int. Older exports are deleted. Default 5.
    """

    def __init__(self, name: str, serving_input_receiver_fn: Callable, exports_to_keep: int = 5):
        super().__init__(name, serving_input_receiver_fn)
        if isinstance(exports_to_keep, bool) or not isinstance(exports_to_keep, int) or exports_to_keep < 1:
            raise ValueError(f"LatestExporter argument 'exports_to_keep' must be an integer >= 1. "
                             f"Received: exports_to_keep={exports_to_keep!r}")
        self.exports_to_keep = exports_to_keep

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        path = estimator.export_saved_model(export_path, self.serving_input_receiver_fn,
                                            checkpoint_path=checkpoint_path)
        stamps = sorted(int(d) for d in os.listdir(export_path) if d.isdigit())
        for stamp in stamps[:-self.exports_to_keep]:
            shutil.rmtree(os.path.join(export_path, str(stamp)), ignore_errors=True)
        return path
