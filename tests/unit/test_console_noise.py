"""Console noise on every run (issue 40, defect 14): Ray's token-authentication notice and MLflow's
ANSI-coloured UserWarnings (``\\x1b[33m... color_warning(`` in plain log files) stay out; other
warnings of the same loggers still get through."""

from __future__ import annotations

import logging
import warnings


def test_ray_token_auth_notice_is_dropped_and_other_warnings_kept(caplog):
    from workers.runtime import quiet_token_auth_notice

    quiet_token_auth_notice()
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Token authentication is disabled for thi"]


def test_mlflow_coloured_model_hints_are_ignored_while_logging_our_model():
    from mlflow.utils.warnings_utils import color_warning

    from flows.tracking import quiet_mlflow_model_hints

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_mlflow_model_hints():
            color_warning("Add type hints to the `predict` method to enable data validation", stacklevel=1,
                          color="yellow")
            color_warning(message="An input example was not provided when logging the model.", stacklevel=1,
                          color="yellow_bold")
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else"]


def test_mlflow_model_hints_are_ignored_under_mlflows_own_once_filter():
    """MLflow checks ``predict`` under its own ``simplefilter("once", UserWarning)``, which goes ahead
    of any filter of ours: the hint still reached the demo's log at the end of every run."""
    from mlflow.utils.annotations import filter_user_warnings_once
    from mlflow.utils.warnings_utils import color_warning

    from flows.tracking import quiet_mlflow_model_hints

    @filter_user_warnings_once
    def check_predict():
        color_warning("Add type hints to the `predict` method to enable data validation", stacklevel=1,
                      color="yellow")
        warnings.warn("something else", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_mlflow_model_hints():
            check_predict()
    assert [str(w.message) for w in seen] == ["something else"]
