"""Calibration of the analytic roofline (`autopp calibrate`): a measured profile's model counted
(autopp.measure.analytic.count_model) and the efficiencies e_c, e_m, t_op and t_call fitted to the times the profile
measured (autopp.costmodel.roofline.fit_efficiency), with each unit's error (docs/analytic.md, "Calibration").
Attention is not fitted on its own: its ratio to the compute efficiency is the device's default one
(`Efficiency.attention_slowdown`: a GPU's 0.3 / 0.6, the CPU's 1), held through the fit."""

from __future__ import annotations

from pathlib import Path

from ..costmodel.roofline import Calibration, Efficiency, FitRow, UnitError, default_efficiency, fit_efficiency
from ..data.catalog import DeviceSpec, identify_device, load_device
from ..data.profile import Profile
from ..errors import ProfileError
from ..model.hf import load_model
from ..progress import Progress
from .analytic import ModelCounts, UnitCount, count_model, runs_fused_attention, unit_times
from .options import ProfileOptions

__all__ = ["fit_rows", "FIT_ROUNDS", "fit_measured", "unit_errors", "calibrate"]


#: Measured phases fitted against counted ones: (profile column, PieceCounts field).
_FITTED = (("forward_s", "forward"), ("backward_s", "backward"), ("backward_input_s", "backward_input"),
           ("backward_weight_s", "backward_weight"))


def _measured_rows(measured: Profile, counts: ModelCounts) -> list[UnitCount]:
    """The counted rows whose unit the profile measured itself (`same_as` -1): a "shared" row copies another unit's
    times, and would weigh that measurement twice in a fit or its errors."""
    own = {(int(u), int(b)) for u, b, same in zip(measured.units.unit, measured.units.microbatch_size,
                                                 measured.units.same_as) if int(same) == -1}
    return [r for r in counts.rows if (r.unit, r.microbatch_size) in own]


def fit_rows(measured: Profile, counts: ModelCounts, spec: DeviceSpec, eff: Efficiency | None = None
             ) -> list[FitRow]:
    """One row per measured (not shared) unit, microbatch size and phase with a measured time above 0: the time and
    the counted load, its ops split at the ridge point of `eff` (default: the datasheet's, efficiencies 1), its
    attention at the device's default ratio to compute (`default_efficiency(...).attention_slowdown`)."""
    peak, bw = spec.peak(measured.meta.dtype), spec.memory_bandwidth_bytes_per_s
    ridge = eff.ridge(peak, bw) if eff is not None else peak / bw
    slowdown = default_efficiency(spec.name).attention_slowdown
    table = measured.units.set_index(["unit", "microbatch_size"])
    rows = []
    for r in _measured_rows(measured, counts):
        for column, phase in _FITTED:
            t = float(table.loc[(r.unit, r.microbatch_size), column])
            if t > 0:
                rows.append(FitRow(getattr(r.counts, phase).load(ridge, 1.0, slowdown), t))
    return rows


#: Most fits of `fit_measured`: each splits the ops at the ridge point of the one before.
FIT_ROUNDS = 5


def fit_measured(data: list[tuple[Profile, ModelCounts]], spec: DeviceSpec) -> Efficiency:
    """Efficiencies fitted to measured profiles and their counts (one dtype): first with the ops split at the
    datasheet's ridge point, then again at the ridge point the fit gives (`Efficiency.ridge`, where `unit_times`
    splits them), until the split stops changing or after FIT_ROUNDS fits. Attention keeps the device's default
    ratio to the compute efficiency (a GPU's e_a = e_c / 2; the CPU's none)."""
    dtype = data[0][0].meta.dtype
    peak, bw = spec.peak(dtype), spec.memory_bandwidth_bytes_per_s
    slowdown = default_efficiency(spec.name).attention_slowdown
    rows = [r for p, c in data for r in fit_rows(p, c, spec)]
    eff = fit_efficiency(rows, peak, bw, slowdown)
    for _ in range(FIT_ROUNDS - 1):
        again = [r for p, c in data for r in fit_rows(p, c, spec, eff)]
        if again == rows:
            break
        rows, eff = again, fit_efficiency(again, peak, bw, slowdown)
    return eff


def unit_errors(measured: Profile, counts: ModelCounts, spec: DeviceSpec, eff: Efficiency) -> list[UnitError]:
    """Per measured (not shared) unit and microbatch size, measured forward + backward against the analytic one with
    `eff`."""
    table = measured.units.set_index(["unit", "microbatch_size"])
    out = []
    for r in sorted(_measured_rows(measured, counts), key=lambda r: (r.microbatch_size, r.unit)):
        times = unit_times(r.counts, spec, counts.options.recipe, eff)
        row = table.loc[(r.unit, r.microbatch_size)]
        out.append(UnitError(r.unit, counts.units[r.unit].name, r.microbatch_size,
                             float(row["forward_s"] + row["backward_s"]), times["forward_s"] + times["backward_s"]))
    return out


def _check_measured_on(measured: Profile, spec: DeviceSpec, where: str) -> None:
    """A profile calibrates only the catalog device it was measured on (a device no catalog entry recognises is
    taken as the named one: the user said which it is)."""
    found = identify_device(measured.meta.device)
    if found is not None and found != spec.name:
        raise ProfileError(f"{where}: measured on {measured.meta.device!r} (catalog device {found}), not "
                           f"{spec.name}; calibrate {spec.name} from a profile measured on it")


def calibrate(measured: Profile, device: str | DeviceSpec, profile_path: str = "", counts: ModelCounts | None = None,
              progress: Progress = lambda _msg: None) -> Calibration:
    """Fit `device`'s efficiencies to a measured profile: its model counted at the profile's microbatch sizes, dtype
    and optimizer (attention as `device` runs it: a GPU's fused kernels, the CPU's), then `fit_measured` over the
    forward, backward, input- and weight-gradient times of every unit the profile measured itself (not the shared
    ones)."""
    spec = device if isinstance(device, DeviceSpec) else load_device(device)
    where = profile_path or "profile"
    _check_measured_on(measured, spec, where)
    if counts is None and not Path(measured.meta.model_path).exists():
        raise ProfileError(f"{where}: its model {measured.meta.model_path} no longer exists; restore it or profile "
                           "the model again")
    c = counts or count_model(load_model(measured.meta.model_path, measured.meta.extra.get("hf_config")),
                              ProfileOptions.recorded(measured.meta), progress,
                              fused_attention=runs_fused_attention(spec))
    if c.fingerprint != measured.meta.fingerprint:
        raise ProfileError(f"{profile_path or measured.meta.model_path}: profile fingerprint "
                           f"{measured.meta.fingerprint} does not match the model ({c.fingerprint}); profile it again")
    eff = fit_measured([(measured, c)], spec)
    return Calibration(device=spec.name, dtype=measured.meta.dtype, efficiency=eff, profile=profile_path,
                       fingerprint=measured.meta.fingerprint, units=tuple(unit_errors(measured, c, spec, eff)))
