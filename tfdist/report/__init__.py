"""Where the step time goes: the step report, the merged timeline, and the one-call breakdown.

* `tfdist.callbacks.StepReport`: the Keras callback (per worker table and JSON).
* `breakdown(model, data, steps)`: one `fit` with a `StepReport`; returns its result.
* `tfdist.report.timeline`: merging the workers' traces of `tfdist launch --timeline`.
* `tfdist.report.recorder`, `trace`, `flops`, `summary`: how the numbers are measured.

`tfdist.report.timeline` imports no TensorFlow (the launcher merges with it);
the other modules are imported when used.
"""

from __future__ import annotations


def breakdown(model, data, steps: int, **fit_kwargs) -> dict:
    """Trains `model` for `steps` steps with a `StepReport` and returns the report (a dict).

    The one-call form for benchmarks and notebooks: `model.fit(data,
    epochs=1, steps_per_epoch=steps, callbacks=[StepReport(verbose=0)],
    verbose=0)`. `data` must yield at least `steps` batches (`repeat()` a
    dataset). The first 2 host calls are warm-up and the next 5 are profiled
    (`StepReport`'s defaults), so `steps` of 20 or more leave steps timed
    without the profiler.

    Args:
        model: a compiled Keras model (under a tfdist strategy or not).
        data: what `fit` takes as `x`: a `tf.data.Dataset`, arrays are not
            accepted here (pass `tf.data.Dataset.from_tensor_slices((x, y)).batch(b).repeat()`).
        steps: int >= 1, the steps to train.
        **fit_kwargs: more arguments of `fit` (not `epochs`, `steps_per_epoch`,
            `callbacks`, `verbose`).

    Returns:
        `StepReport.result`.

    Example:

    ```python
    result = tfdist.report.breakdown(model, dataset.repeat(), steps=40)
    print(result["samples_per_s"], result["phases_s"])
    ```
    """
    from tfdist.callbacks import StepReport

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Argument 'steps' must be an integer >= 1. Received: steps={steps!r}")
    report = StepReport(verbose=0)
    model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=[report], verbose=0, **fit_kwargs)
    return report.result
