"""The changes that would lower a plan's peak: each with the bytes it frees per phase and how that is known
(exact, traced, or an estimate to trace), and the largest term of a phase's peak."""

from __future__ import annotations

from train.algorithm.update_config import UpdateMode
from train.tools.plan.report import Phase, PlanReport, in_gib

Saving = tuple[str, dict[str, float], str]  # (the change, bytes it frees per phase name, how that is known)


def _everywhere(names: list[str], num_bytes: float) -> dict[str, float]:
    return dict.fromkeys(names, float(num_bytes))


def _static_savings(report: PlanReport, names: list[str]) -> list[Saving]:
    out: list[Saving] = []
    text = sum(m.num_bytes for m in report.frozen if m.role == "text encoder")
    if text:
        change = "model.embedding_cache=<folder> (scripts/precompute_embeddings.py): no text encoders"
        out.append((change, _everywhere(names, text), "exact"))
    if not report.lora:  # the rollout and the decode hold no gradients in any case
        held = report.optimizer_bytes + report.reference_bytes + report.ema_bytes
        saved = {n: float(held + (report.grad_bytes if n not in ("rollout", "decode") else 0)) for n in names}
        change = "model.lora.enabled=true: no full-size gradients, optimizer state, KL reference copy or EMA"
        out.append((change, saved, "estimate; trace it with model.lora.enabled=true"))
    evaluation = sum(m.num_bytes for m in report.frozen if m.role == "eval scorer")
    if evaluation:
        change = "eval.every=0 (evaluate with python -m train.eval): no evaluation scorers kept"
        out.append((change, _everywhere(names, evaluation), "exact"))
    if report.velocity_bytes:
        change = "update.offload_velocities=true: the rollout's velocities in host memory"
        out.append((change, _everywhere(names, report.velocity_bytes), "exact"))
    return out


def _working_savings(report: PlanReport) -> list[Saving]:
    out: list[Saving] = []
    current = {u.name: u for u in report.configured_updates()}
    if not report.checkpointing:
        other = {u.name: u for u in report.updates if u.checkpointing}
        saved = {name: float(u.peak_bytes - other[name].peak_bytes) for name, u in current.items()}
        out.append(("model.activation_checkpointing=true", saved, "traced"))
    if report.segments.get(UpdateMode.jagg, 0) > 0:
        saved = {name: u.activation_bytes / 2 for name, u in current.items() if u.mode == UpdateMode.jagg}
        change = "update.mode=jagg_sequential: one endpoint graph alive instead of two"
        out.append((change, saved, "estimate; trace it with update.mode=jagg_sequential"))
    if report.micro_batch > 1:
        share = 1 - 1 / report.micro_batch
        saved = {p.name: p.working_bytes * share for p in report.step_phases() if p.name != "decode"}
        out.append(("batch.micro_batch=1", saved, "estimate; trace it with batch.micro_batch=1"))
    decode = next(p for p in report.phases if p.name == "decode")
    per_call = report.decode_batch if 0 < report.decode_batch < report.samples_per_rank else report.samples_per_rank
    for rows in (16, 8, 4, 2, 1):  # the largest chunk that fits, if one does: working memory ~ images per call
        saved = {"decode": decode.working_bytes * (1 - rows / per_call)}
        if rows < per_call and (decode.peak_bytes - saved["decode"] <= report.budget_bytes or rows == 1):
            out.append((f"model.decode_batch={rows}", saved, f"estimate; trace it with model.decode_batch={rows}"))
            break
    return out


def advice(report: PlanReport) -> list[str]:
    """One line per change that lowers the peak: the step's peak it would leave, and whether that fits."""
    names = [p.name for p in report.step_phases()]
    lines = []
    for change, saved, how in _static_savings(report, names) + _working_savings(report):
        peak = max(p.peak_bytes - saved.get(p.name, 0) for p in report.step_phases())
        if peak < report.peak.peak_bytes:
            verdict = "fits" if peak <= report.budget_bytes else "does not fit"
            lines.append(f"  {change}: peak {in_gib(peak)} GiB, {verdict} ({how})")
    return lines


def largest_term(report: PlanReport, phase: Phase) -> str:
    terms = {
        f"{phase.name} working memory": phase.working_bytes,
        "transformer shards": report.param_bytes,
        "optimizer state": report.optimizer_bytes,
        "KL reference shards": report.reference_bytes,
        "EMA shards": report.ema_bytes,
        "step tensors": report.step_tensor_bytes,
        **{f"{m.role} {m.name}": m.num_bytes for m in report.frozen},
    }
    if phase.name not in ("rollout", "decode"):
        terms["gradients"] = report.grad_bytes
    name = max(terms, key=lambda term: terms[term])
    return f"{name} ({in_gib(terms[name])} GiB)"
