"""The suite's goals, checked against what it measured (the "Targets" table):

  * SMB sync all-reduce at least 4x faster than Horovod-MPI, and within 2x of memcpy;
  * an SMB async step at least 4x faster than Horovod-MPI's all-reduce, and no slower
    than SMB's own sync all-reduce;
  * model.fit of the MLP: SMB sync at least as fast as Horovod, Horovod as MWMS;
  * model.fit of every fit model: the step time SMB sync adds over one process with
    the same global batch at most 1/4 of what Horovod-MPI adds;
  * a 1-worker SMBStrategy at most 5% slower than no strategy.

On TARGET_MODEL's shapes (else the largest model measured), at each worker count.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from benchmarks.report import Cell, fmt, overhead_pct, ratio
from benchmarks.strategies import LABELS

TARGET_MODEL = "resnet50"


def target_row(what: str, measured: str, goal: str, ok: Optional[bool]) -> List[str]:
    return [what, measured, goal, "n/a" if ok is None else ("met" if ok else "missed")]


def compute_targets(comm: Dict[Tuple[str, int, str], Cell], comm_models: List[str],
                    worlds: List[int], model_bytes: Dict[str, int],
                    fit: Dict[Tuple[str, str], Cell], fit_models: List[str],
                    fit_workers: int, fit_batch: int) -> List[List[str]]:
    """The rows of the targets table: (target, measured, goal, met / missed / n/a)."""
    rows: List[List[str]] = []
    if comm_models:
        model = (TARGET_MODEL if TARGET_MODEL in comm_models
                 else max(comm_models, key=lambda m: model_bytes[m]))
        for world in worlds:
            def get(s: str) -> Cell:
                return comm.get((model, world, s), Cell(None, "not measured"))
            smb, mpi, copy = get("smb_sync"), get("horovod_mpi"), get("memcpy")
            where = f"{model}, {world} workers"

            def four_times_mpi(target: str, label: str, cell: Cell) -> List[str]:
                r = ratio(mpi.value, cell.value)
                return target_row(
                    f"{target} ({where})",
                    f"{fmt(r, '.2f')}x faster ({label} {fmt(cell.value)} ms, Horovod-MPI "
                    f"{fmt(mpi.value)} ms)" if r else f"n/a ({mpi.reason or cell.reason})",
                    ">= 4x faster", None if r is None else r >= 4)

            rows.append(four_times_mpi("SMB sync all-reduce vs Horovod-MPI", "SMB", smb))
            r = ratio(smb.value, copy.value)
            rows.append(target_row(
                f"SMB sync all-reduce vs memcpy ({where})",
                f"{fmt(r, '.2f')}x memcpy (SMB {fmt(smb.value)} ms, memcpy "
                f"{fmt(copy.value)} ms)" if r else f"n/a ({smb.reason})",
                "within 2x", None if r is None else r <= 2))
            for name, step in (("smb_async", "SMB async step"),
                               ("smb_async_push", "SMB async step (read_at=push)")):
                cell = get(name)
                if name != "smb_async" and cell.value is None:
                    continue  # an option: only when measured
                rows.append(four_times_mpi(f"{step} vs Horovod-MPI all-reduce",
                                           LABELS[name], cell))
                r = ratio(smb.value, cell.value)
                rows.append(target_row(
                    f"{step} vs SMB sync all-reduce ({where})",
                    f"{fmt(r, '.2f')}x as fast ({LABELS[name]} {fmt(cell.value)} ms, SMB sync "
                    f"{fmt(smb.value)} ms)" if r else f"n/a ({cell.reason or smb.reason})",
                    "no slower", None if r is None else r >= 1))
    if "mlp" in fit_models:
        smb, mwms = fit.get(("mlp", "smb_sync"), Cell()), fit.get(("mlp", "mwms"), Cell())
        hvd_name = "horovod_mpi" if fit.get(("mlp", "horovod_mpi"), Cell()).value else \
            "horovod_gloo"
        hvd = fit.get(("mlp", hvd_name), Cell(None, "not measured"))
        label = LABELS[hvd_name]
        ok = None if smb.value is None or hvd.value is None else smb.value >= hvd.value
        rows.append(target_row(
            f"fit samples/s, mlp, {fit_workers} workers: SMB sync >= {label}",
            f"SMB {fmt(smb.value, '.0f')}, {label} {fmt(hvd.value, '.0f')}"
            + (f" ({hvd.reason or smb.reason})" if ok is None else ""), "SMB >= Horovod", ok))
        ok = None if hvd.value is None or mwms.value is None else hvd.value >= mwms.value
        rows.append(target_row(
            f"fit samples/s, mlp, {fit_workers} workers: {label} >= MWMS",
            f"{label} {fmt(hvd.value, '.0f')}, MWMS {fmt(mwms.value, '.0f')}"
            + (f" ({mwms.reason or hvd.reason})" if ok is None else ""), "Horovod >= MWMS", ok))
    for model in fit_models:
        rows.append(added_step_time_row(fit, model, fit_workers, fit_batch))
    for model in fit_models:
        none, smb = fit.get((model, "none_1")), fit.get((model, "smb_1"))
        if none is None or smb is None:
            continue
        over = overhead_pct(none.value, smb.value)
        rows.append(target_row(
            f"1-worker SMBStrategy overhead vs no strategy, fit {model}",
            f"{fmt(over, '.1f')}% (none {fmt(none.value, '.0f')}, SMB {fmt(smb.value, '.0f')} "
            f"samples/s)" if over is not None else f"n/a ({none.reason or smb.reason})",
            "<= 5%", None if over is None else over <= 5))
    return rows


def added_step_time_row(fit: Dict[Tuple[str, str], Cell], model: str, fit_workers: int,
                        batch: int) -> List[str]:
    """What SMB sync and Horovod-MPI add to one process's step on the same global batch
    (ms per step, from samples/s): SMB's addition must be at most 1/4 of Horovod's."""
    def step_ms(name: str) -> Optional[float]:
        cell = fit.get((model, name))
        return None if cell is None or not cell.value else 1000.0 * batch / cell.value

    one, smb, hvd = step_ms("none_1"), step_ms("smb_sync"), step_ms("horovod_mpi")
    what = (f"fit step time added over one process, {model}, {fit_workers} workers: "
            "SMB sync vs Horovod-MPI")
    if one is None or smb is None or hvd is None:
        return target_row(what, "n/a (needs one process, SMB sync and Horovod-MPI fits)",
                          "<= 1/4 of Horovod's", None)
    smb_added, hvd_added = smb - one, hvd - one
    measured = (f"SMB {smb_added:+.2f} ms, Horovod-MPI {hvd_added:+.2f} ms per step (one "
                f"process {one:.2f} ms)")
    if hvd_added <= 0:
        return target_row(what, measured + ": Horovod adds nothing to compare with",
                          "<= 1/4 of Horovod's", None)
    share = smb_added / hvd_added
    return target_row(what, f"{measured}: SMB adds {share:.2f}x of Horovod's",
                      "<= 1/4 of Horovod's", share <= 0.25)
