"""tests/models/gncnn.py with BatchNorm: in training it normalizes by the statistics of the batch it is given, a
microbatch under pipelining, so a pipelined step cannot equal the single-process step (issue 26, point 11)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("autopp_test_gncnn", Path(__file__).with_name("gncnn.py"))
assert _spec is not None and _spec.loader is not None
_gn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gn)
_gn.NORM = "batch"

build_model, sample_batch, loss_fn = _gn.build_model, _gn.sample_batch, _gn.loss_fn
