"""The model side (torch): the model-file contract, unit discovery, and splitting a model into pipeline pieces."""

from __future__ import annotations

from .contract import ModelFile, check_forward, default_loss, load_model_file
from .split import LiveValue, TiedGroup, live_values, split_model, tied_groups
from .units import Unit, discover_units, fingerprint

__all__ = ["ModelFile", "load_model_file", "check_forward", "default_loss", "Unit", "discover_units", "fingerprint",
           "split_model", "LiveValue", "live_values", "TiedGroup", "tied_groups"]
