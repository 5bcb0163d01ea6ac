"""The one staged search on validation sequences, behind ``kvpop train --auto`` and ``kvpop demo --select``.

A search is a list of :class:`Stage`: each stage tries its variations of the best settings so far, and the best
trial is what the next stage varies.  The best is decided by the one selection rule, :func:`prefer` (through
:func:`choose`): a trial is scored per select sequence (``per_sequence``, lower is better; ``score`` their mean),
and a challenger replaces the incumbent only when its paired mean improvement exceeds :data:`MARGIN_SE` standard
errors; otherwise, ties included, the incumbent (the earlier, cheaper trial) stays.  :meth:`Search.confirm`
retrains the top two with a second seed and decides on the mean (:func:`confirm_choice`).  :class:`Search`
runs the stages and keeps the record, ``OUT/<record file>``, written after every trial::

    {..., "split": {"fit", "select"}, "trials": [{"stage", "settings", "score", "per_sequence", "steps",
     "seconds", "dir", ...}], "skipped": [...], "stages": [...], "decisions": [{"stage", "incumbent",
     "challenger", "mean_diff", "se", "margin", "adopted", ...}], "confirmation": ..., "summary": ...,
     "chosen": ...}

Every trial runs in its own directory (``OUT/<subdir>/<tag of its settings>``, :func:`trial_tag`) and leaves
``trial.json`` there when it is finished; a trial whose ``trial.json`` holds the same settings is reused, never
run again, so an interrupted search continues where it stopped.  A budget (trained steps, or minutes of the
trials' wall time) skips a stage's trials once it would be overrun; the first trained trial always runs.

What a trial *is* (one ``kvpop train`` run scored as ``kvpop eval --run`` serves it; one demo retrofit scored on
the task's validation sequences) is the caller's ``run(settings, dir)``; what is searched is a plan:

* ``kvpop train --auto``'s stages: beside its trials, in :mod:`kvpop.training.auto` (``auto_plan``: the label
  family by its oracle, the scorer lr, head-adaptive budgets, the training budget, the label source, the decay
  range, the warm start);
* ``kvpop demo --select``'s stages for each of the demo's retrofits: beside the demo, in :mod:`kvpop.demo.grid`
  (``select_plan`` over ``SELECT_GRID``; :mod:`kvpop.demo.search` runs them).

This module imports nothing above :mod:`kvpop.core`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpop.core.files import write_json

from .trial_records import check_score, file_record, read_trial, start_trial

__all__ = ["Stage", "Search", "choose", "prefer", "paired", "resolution", "split_keys", "MARGIN_SE", "MIN_SELECT",
           "top_two", "confirm_choice", "cannot_tell", "tie_break", "power", "POWER_Z",
           "trial_tag"]


MARGIN_SE = 2.0
"""The selection rule's margin in paired standard errors: a challenger replaces the incumbent only when its mean
improvement over the same select sequences exceeds ``MARGIN_SE`` times the standard error of that mean
(docs/DESIGN.md section 7, "Selection")."""
MIN_SELECT = 8
"""Fewer select sequences than this get a warning: their standard error is itself too noisy to trust."""
POWER_Z = 2.8
"""A true difference of ``POWER_Z`` standard errors is adopted by the rule (2 standard errors) with about 80 %
probability (``2 + 0.84``, rounded up: :func:`power`)."""


def paired(incumbent: Sequence[float], challenger: Sequence[float], *, higher_is_better: bool = False
           ) -> tuple[float, float | None]:
    """``(mean_diff, se)``: the mean of the per-sequence improvements of ``challenger`` over ``incumbent`` (the
    same sequences in the same order; positive: the challenger is better) and its standard error (the sample
    standard deviation of the differences, ``n - 1`` in the denominator, over ``sqrt(n)``; ``None`` for one
    sequence).  ValueError when the lengths differ."""
    if len(incumbent) != len(challenger) or not incumbent:
        raise ValueError(f"paired scores need the same sequences: {len(incumbent)} against {len(challenger)}")
    sign = 1.0 if higher_is_better else -1.0
    d = [sign * (float(c) - float(i)) for i, c in zip(incumbent, challenger)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def prefer(incumbent: dict, challenger: dict, *, key: str = "score", higher_is_better: bool = False,
           stage: str | None = None, margin_se: float = MARGIN_SE) -> dict:
    """The one selection rule: does ``challenger`` replace ``incumbent``?  Returns the decision
    ``{"stage", "incumbent", "challenger", "mean_diff", "se", "margin", "adopted", "n", "paired"}``
    (``incumbent`` / ``challenger``: the trials' settings).

    Both trials' ``per_sequence`` (scores on the same select sequences, in order): adopted only when the mean
    improvement exceeds ``margin_se`` paired standard errors (:func:`paired`), strictly; otherwise, a tie
    included, the incumbent (the earlier, simpler trial) stays; one sequence has no standard error and never
    replaces the incumbent.  A trial without ``per_sequence`` (a record written before the rule) is compared by
    ``key`` alone (``paired`` false, no margin: strictly better replaces)."""
    a, b = incumbent.get("per_sequence"), challenger.get("per_sequence")
    out: dict = {"stage": stage if stage is not None else challenger.get("stage"),
                 "incumbent": incumbent.get("settings"), "challenger": challenger.get("settings")}
    if a is not None and b is not None and len(a) == len(b) and a:
        mean, se = paired(a, b, higher_is_better=higher_is_better)
        margin = None if se is None else margin_se * se
        return {**out, "mean_diff": mean, "se": se, "margin": margin, "adopted": margin is not None and mean > margin,
                "n": len(a), "paired": True}
    mean = (challenger[key] - incumbent[key]) * (1.0 if higher_is_better else -1.0)
    return {**out, "mean_diff": mean, "se": None, "margin": 0.0, "adopted": mean > 0, "n": None, "paired": False}


def cannot_tell(decision: Mapping[str, Any]) -> bool:
    """Whether a :func:`prefer` decision could not tell the two trials apart: paired, with a standard error, and
    the mean difference within the margin either way (neither is better by the rule)."""
    m = decision.get("margin")
    return bool(decision.get("paired")) and m is not None and abs(decision["mean_diff"]) <= m


def tie_break(decision: dict, incumbent: Mapping[str, Any], challenger: Mapping[str, Any],
              cost: Callable[[Mapping[str, Any]], Any] | None) -> dict:
    """``decision`` (:func:`prefer`'s) with the rule for two trials it :func:`cannot_tell` apart: the one cheaper
    by ``cost(settings)`` (a sortable key, e.g. what serving and training it costs) is kept, the incumbent
    when they cost the same (or ``cost`` is ``None``); ``cannot_tell`` (with the ``interval`` of the mean
    difference, ``mean_diff`` +- ``margin``) and ``tie_break`` (what decided) are added.  A decision the rule
    made is returned as it is, with ``cannot_tell`` false."""
    if not cannot_tell(decision):
        return {**decision, "cannot_tell": False}
    m, md = decision["margin"], decision["mean_diff"]
    out = {**decision, "cannot_tell": True, "interval": [md - m, md + m]}
    if cost is not None and cost(challenger["settings"]) < cost(incumbent["settings"]):
        return {**out, "adopted": True, "tie_break": "cannot tell: the challenger is cheaper to serve or train"}
    return {**out, "adopted": False, "tie_break": "cannot tell: the incumbent costs no more, so it stays"}


def choose(trials: Sequence[dict], *, key: str = "score", higher_is_better: bool = True,
           decisions: list | None = None, stage: str | None = None) -> dict:
    """The choice among ``trials`` in their order: the first is the incumbent, and each later trial replaces it
    only when :func:`prefer` (the one selection rule) adopts it.  The selection of every search (:class:`Search`,
    lower is better) and of every evidence row, KVpop's and DMS's alike (:mod:`studies.ledger`); each
    decision is appended to ``decisions`` when given."""
    if not trials:
        raise ValueError("choose needs at least one trial")
    best = trials[0]
    for t in trials[1:]:
        d = prefer(best, t, key=key, higher_is_better=higher_is_better, stage=stage)
        if decisions is not None:
            decisions.append(d)
        if d["adopted"]:
            best = t
    return best


def top_two(best: dict, trials: Sequence[dict], *, higher_is_better: bool = False) -> list[dict] | None:
    """``best`` and the runner-up (the rule's choice among the other ``trials``), in the order of ``trials``
    (the earlier first); ``None`` when there is no other trial."""
    others = [t for t in trials if t is not best]
    if not others:
        return None
    second = choose(others, higher_is_better=higher_is_better)
    order = {id(t): i for i, t in enumerate(trials)}
    return sorted([best, second], key=lambda t: order.get(id(t), -1))


def confirm_choice(best: dict, trials: Sequence[dict], retrain: Callable[[dict], dict], *, seed: tuple[str, int],
                   higher_is_better: bool = False,
                   cost: Callable[[Mapping[str, Any]], Any] | None = None) -> tuple[dict, dict]:
    """The confirmation of every search: ``best`` (the rule's choice among ``trials``) and the runner-up
    (:func:`top_two`) each trained again with the second seed (``retrain(trial)``: its ``score`` and
    ``per_sequence`` on the same select sequences), and :func:`prefer` deciding on each trial's per-sequence
    scores averaged over its two seeds, the earlier trial the incumbent; ``cost``: two trials it cannot tell apart
    are decided by :func:`tie_break`.  Returns ``(chosen trial, the record's confirmation: "ran", the seed,
    "trials" with both seeds' scores, "decision", "chosen", "changed")``."""
    pair = top_two(best, trials, higher_is_better=higher_is_better)
    if pair is None:
        return best, {"ran": False, "why": "one trial: no runner-up to confirm against"}
    means = []
    for t in pair:
        r = retrain(t)
        ps = None
        if t.get("per_sequence") is not None and r.get("per_sequence") is not None:
            ps = [(a + b) / 2 for a, b in zip(t["per_sequence"], r["per_sequence"])]
        means.append({"settings": t["settings"], "score": (t["score"] + r["score"]) / 2, "per_sequence": ps,
                      "seeds": [{"dir": t.get("dir"), "score": t["score"]},
                                {"dir": r.get("dir"), "score": r["score"], seed[0]: seed[1]}]})
    d = prefer(means[0], means[1], higher_is_better=higher_is_better, stage="confirmation")
    if cost is not None:
        d = tie_break(d, means[0], means[1], cost)
    chosen = pair[1] if d["adopted"] else pair[0]
    return chosen, {"ran": True, seed[0]: seed[1], "trials": means, "decision": d, "chosen": chosen["settings"],
                    "changed": chosen is not best}


def resolution(n: int, spread: float | None = None, *, margin_se: float = MARGIN_SE) -> str:
    """What ``n`` select sequences can resolve, in words: the smallest mean difference the rule adopts given the
    per-sequence spread of differences ``spread`` (a standard deviation; unknown before two trials), and a
    warning below :data:`MIN_SELECT`."""
    if n < 2:
        text = f"{n} select sequence: no standard error, so no challenger can replace the first trial"
    elif spread is None:
        text = (f"{n} select sequences: a challenger must beat the incumbent by {margin_se:g} paired standard "
                f"errors (the per-sequence spread / sqrt({n}))")
    else:
        text = (f"{n} select sequences: with a per-sequence spread of differences of {spread:.3g}, a challenger "
                f"must improve the mean by more than {margin_se * spread / math.sqrt(n):.3g}")
    if n < MIN_SELECT:
        text += f"; warning: fewer than {MIN_SELECT} select sequences resolve only large differences"
    return text


def power(n: int, spread: float | None, *, target: float, spread_of: str,
          margin_se: float = MARGIN_SE) -> dict:
    """What ``n`` select sequences can resolve, as numbers, given ``spread`` (the standard deviation of a paired
    per-sequence difference, e.g. between two label oracles): ``resolvable`` the smallest mean difference the rule
    adopts (``margin_se`` standard errors), ``detectable_80`` the true difference it adopts with about 80 %
    probability (:data:`POWER_Z` standard errors), and ``n_for_target`` the select sequences that detect a
    difference of ``target`` so (``ceil((POWER_Z * spread / target) ** 2)``); ``spread`` ``None`` or ``n < 2``:
    the numbers are ``None``.  ``spread_of``: where the spread was measured, for the record."""
    out: dict = {"n_select": n, "spread": spread, "spread_of": spread_of, "target": target,
                 "resolvable": None, "detectable_80": None, "n_for_target": None}
    if spread is None or n < 2 or not math.isfinite(spread):
        return out
    se = spread / math.sqrt(n)
    return {**out, "resolvable": margin_se * se, "detectable_80": POWER_Z * se,
            "n_for_target": max(2, math.ceil((POWER_Z * spread / target) ** 2))}


def split_keys(keys: Sequence[str], seed: int, *, n_fit: int | None = None) -> tuple[list[int], list[int]]:
    """``(fit, select)``: the indices of ``keys`` (one per validation record) split by a seeded hash: ordered by
    ``sha256(f"{seed}:{key}")``, the first half (rounded up) to *select* and the rest to *fit*, disjoint, each
    part in its original order; equal keys (duplicate records) go to the same part.  ``n_fit``: where more than
    twice ``n_fit`` distinct keys are given, only the last ``n_fit`` in that order go to *fit* and every other
    to *select* (more select sequences resolve smaller differences; the fit part needs few)."""
    import hashlib

    uniq = list(dict.fromkeys(keys))
    order = sorted(uniq, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())
    n_sel = len(order) - n_fit if n_fit is not None and len(order) > 2 * n_fit else (len(order) + 1) // 2
    sel = set(order[:n_sel])
    return ([i for i, k in enumerate(keys) if k not in sel], [i for i, k in enumerate(keys) if k in sel])


@dataclass(frozen=True)
class Stage:
    """One stage of a search: ``variations`` (each a dict of settings) over a starting point.

    ``start=None``: each variation updates the best settings so far, and that best trial stays a candidate (a
    variation that changes nothing is not run again).  ``start`` a dict: the stage starts anew from the best
    settings so far (none before the first stage) updated by ``start``; the trials before are no longer compared
    (their score measured something else: the oracle's stage before the trained ones).  ``trained``: whether
    the trials train (only those count against the search's budget).  ``when``: a test of the best settings so
    far; a stage whose test fails runs nothing (status ``"not applicable"``), e.g. a stage varying the learned
    scorer once a fixed mask was chosen."""

    name: str
    variations: Sequence[Mapping[str, Any]]
    start: Mapping[str, Any] | None = None
    trained: bool = True
    when: Callable[[Mapping[str, Any]], bool] | None = None


def trial_tag(settings: Mapping[str, Any]) -> str:
    """The directory name of a trial with ``settings``: ``key-value`` pairs in key order, the keys without
    underscores (``lrscorer-0.01_steps-200``)."""
    def fmt(v):
        return "none" if v is None else v if isinstance(v, str) else f"{v:g}"

    return "_".join(f"{k.replace('_', '')}-{fmt(v)}" for k, v in sorted(settings.items()))


class _Budget:
    def __init__(self, budget: tuple[str, float] | None):
        self.unit, self.value = budget if budget is not None else (None, None)
        self.steps = 0
        self.minutes = 0.0
        self.trained = 0
        self.reserve = 0  # steps kept for the confirmation (a steps budget only)

    def add(self, r: dict) -> None:
        self.steps += r["steps"]
        self.minutes += (r["seconds"] or 0.0) / 60
        self.trained += r["steps"] > 0

    def spent_before(self, steps: int, *, reserve: bool = True) -> bool:
        if self.unit is None or not self.trained:
            return False
        if self.unit == "steps":
            return self.steps + steps > self.value - (self.reserve if reserve else 0)
        return self.minutes >= self.value


@dataclass
class Search:
    """A staged search's record ``out / record_file`` and its trials' directories under ``out``.

    ``header``: the record's fixed entries (what is searched, the criterion, the validation sequences);
    ``budget``: ``("steps" | "minutes", value)`` or ``None`` (every trial runs); ``log(line)``: progress."""

    out: Path
    record_file: str = "selection.json"
    header: Mapping[str, Any] = field(default_factory=dict)
    budget: tuple[str, float] | None = None
    log: Callable[[str], None] = print
    prefix: str = "[kvpop search]"
    inputs: Mapping[str, Any] | None = None
    """What the trials run under (:func:`kvpop.training.trial_records.search_inputs`), recorded in each trial and
    checked before one is reused or continued; ``None``: not recorded (the records' schema is checked all the
    same, :func:`kvpop.training.trial_records.read_trial`)."""
    cost: Callable[[Mapping[str, Any]], Any] | None = None
    """What a trial of given settings costs to serve and train (a sortable key): of two trials the rule cannot
    tell apart (:func:`tie_break`), the cheaper is kept; ``None``: the incumbent stays.  Every such pair is
    listed in the record's ``cannot_tell``."""
    scales: Mapping[bool, str] = field(default_factory=lambda: {False: "oracle score", True: "validation score"})
    """What an untrained (``False``) and a trained (``True``) trial's score is, in the log's words."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.record: dict = {**self.header, "trials": [], "skipped": [], "decisions": [], "cannot_tell": [],
                             "stages": [], "chosen": None}
        if self.budget is not None:
            self.record["budget"] = {"unit": self.budget[0], "value": self.budget[1]}
        self._spent = _Budget(self.budget)
        self.compared: list[dict] = []

    def reserve(self, steps: int) -> None:
        """Keep ``steps`` of a steps budget for :meth:`confirm`: :meth:`run_plan`'s trials stop short of them."""
        self._spent.reserve = steps

    @property
    def spent(self) -> dict:
        """``{"steps", "minutes", "trained"}`` so far (reused trials included)."""
        return {"steps": self._spent.steps, "minutes": self._spent.minutes, "trained": self._spent.trained}

    def save(self) -> None:
        """Write the record (atomically)."""
        write_json(self.out / self.record_file, self.record)

    def trial(self, stage: str, settings: dict, run: Callable[[dict, Path], dict], *, trained: bool = True,
              steps: int = 0, subdir: str = "", extra: Mapping[str, Any] | None = None,
              scale: str | None = None) -> dict | None:
        """One trial of ``settings`` in ``out/subdir/<tag>``: reused when that holds a finished one of the same
        settings, ``None`` (recorded under ``skipped``) when the budget is spent, else ``run(settings, dir)`` (a
        dict with ``"score"`` and the trained ``"steps"``; any other entries are kept in the trial's record).
        A trial this search ran (or reused) before is returned as it is, not recorded twice.  ``steps``: what the
        trial will train, for the budget; ``extra``: entries every trial of this call's record carries first
        (``{"policy": ...}``); ``scale``: what its score is, for the log (default :attr:`scales` of ``trained``)."""
        scale = scale or self.scales[trained]
        d = self.out / subdir / trial_tag(settings)
        f = d / "trial.json"
        rel = str(d.relative_to(self.out))
        seen = next((r for r in self.record["trials"] if r["dir"] == rel and r["settings"] == settings), None)
        if seen is not None:  # tried before in this search (a later stage came back to it): the same trial
            return seen
        if f.exists():
            r = read_trial(f, out=self.out, settings=settings, inputs=self.inputs)  # None: another trial's
            if r is not None:
                self.log(f"{self.prefix} {stage} {settings}: finished before, {scale} {r['score']:.5f} "
                         f"(reused)")
                return self._keep(r)
        if trained and self._spent.spent_before(steps):
            self.record["skipped"].append({**(extra or {}), "stage": stage, "settings": settings, "steps": steps,
                                           "why": f"the budget of {self.budget[1]:g} {self.budget[0]} is spent"})
            self.save()
            return None
        d.mkdir(parents=True, exist_ok=True)
        if self.inputs is not None:
            start_trial(d, self.inputs)
        self.log(f"{self.prefix} {stage} {settings}: started in {d}")
        t0 = time.time()
        res = dict(run(settings, d))
        score = check_score(float(res.pop("score")), d)  # a NaN would never be beaten: refused, naming the trial
        r = {**(extra or {}), "stage": stage, "settings": settings, "score": score,
             "steps": int(res.pop("steps", 0)), "seconds": round(time.time() - t0, 1), "dir": rel, **res}
        write_json(f, file_record(r, self.inputs))
        n = len(r.get("per_sequence") or [])
        self.log(f"{self.prefix} {stage} {settings}: {scale} {r['score']:.5f}"
                 f"{f' over {n} select sequences' if n else ''} ({r['seconds']:.0f} s)")
        return self._keep(r)

    def _keep(self, r: dict) -> dict:
        self.record["trials"].append(r)
        self._spent.add(r)
        self.save()
        return r

    def run_plan(self, plan: Sequence[Stage], run: Callable[[dict, Path], dict], *,
                 oracle: Callable[[dict, Path], dict] | None = None, steps_of: Callable[[dict], int] = lambda s: 0,
                 subdir: str = "", extra: Mapping[str, Any] | None = None) -> dict:
        """Run the stages of ``plan`` (their trials: ``run``, an untrained stage's: ``oracle``, both as
        :meth:`trial` takes them) and return the best trial of the stages since the last that started anew;
        ``steps_of(settings)``: the steps a trial of ``settings`` trains (for the budget)."""
        best: dict | None = None
        prev: dict = {}
        group: list[dict] = []
        for st in plan:
            if st.when is not None and st.start is not None:
                raise ValueError(f"stage {st.name!r}: a stage that starts anew cannot be conditional (when)")
            if st.start is not None:
                base, best, group = {**prev, **st.start}, None, []
            elif best is None:
                raise ValueError(f"stage {st.name!r} varies the best settings so far, but no trial ran before it")
            else:
                base = best["settings"]
            if st.when is not None and not st.when(base):
                self.record["stages"].append({**(extra or {}), "stage": st.name, "trained": st.trained, "ran": 0,
                                              "skipped": 0, "status": "not applicable"})
                continue
            ran = skipped = 0
            for v in st.variations:
                s = {**base, **v}
                if best is not None and s == best["settings"]:
                    continue
                if not st.trained and oracle is None:
                    raise ValueError(f"stage {st.name!r} is untrained: run_plan needs an oracle")
                r = self.trial(st.name, s, run if st.trained else oracle, trained=st.trained,
                               steps=steps_of(s) if st.trained else 0, subdir=subdir, extra=extra)
                if r is None:
                    skipped += 1
                    continue
                ran += 1
                if all(g is not r for g in group):
                    group.append(r)
                if best is None:
                    best = r
                else:
                    d = self.decide(best, r, stage=st.name, extra=extra)
                    best = r if d["adopted"] else best
            self.record["stages"].append({**(extra or {}), "stage": st.name, "trained": st.trained, "ran": ran,
                                          "skipped": skipped, "status": "ran" if not skipped else
                                          "skipped for budget" if not ran else "partly skipped for budget"})
            if best is None:
                raise ValueError(f"stage {st.name!r} ran no trial (its variations: {list(st.variations)})")
            prev = best["settings"]
        if best is None:
            raise ValueError("an empty plan")
        self.compared = group
        self.save()
        return best

    def decide(self, incumbent: dict, challenger: dict, *, stage: str,
               extra: Mapping[str, Any] | None = None) -> dict:
        """:func:`prefer`'s decision between two trials, a pair it cannot tell apart decided by :func:`tie_break`
        (``cost``) and listed under ``cannot_tell``; recorded under ``decisions``."""
        d = tie_break(prefer(incumbent, challenger, stage=stage), incumbent, challenger, self.cost)
        self._note_decision(d, extra)
        return d

    def _note_decision(self, d: dict, extra: Mapping[str, Any] | None) -> None:
        self.record["decisions"].append({**(extra or {}), **d})
        if d.get("cannot_tell"):
            self.record.setdefault("cannot_tell", []).append(
                {**(extra or {}), "stage": d["stage"], "a": d["incumbent"], "b": d["challenger"],
                 "mean_diff": d["mean_diff"], "interval": d["interval"],
                 "kept": d["challenger"] if d["adopted"] else d["incumbent"], "by": d["tie_break"]})

    def confirm(self, best: dict, run: Callable[[dict, Path], dict], *, seed: tuple[str, int],
                steps_of: Callable[[dict], int] = lambda s: 0, subdir: str = "",
                extra: Mapping[str, Any] | None = None, raise_hint: str = "") -> tuple[dict, dict]:
        """The confirmation of :meth:`run_plan`'s choice ``best``: it and the runner-up (the choice by the rule
        among the other trials :meth:`run_plan` compared last) trained again with ``settings[seed[0]] =
        seed[1]`` (stage ``confirmation``), and the choice made by :func:`prefer` on each trial's per-sequence
        scores averaged over its two seeds, the earlier of the two trials the incumbent.  Returns ``(chosen
        trial, the confirmation record)``; it does not run (the record says why) when there is no runner-up or
        the budget cannot pay for both trials (``raise_hint``: what to raise, in words, with the steps
        needed)."""
        trained = [t for t in self.compared if t["steps"] > 0]
        pair = top_two(best, trained, higher_is_better=False)
        if pair is None or best["steps"] <= 0:
            return best, {"ran": False, "why": "one trained trial: no runner-up to confirm against"}
        second = pair[1] if pair[0] is best else pair[0]
        cost = sum(steps_of(t["settings"]) for t in pair)
        if self._spent.unit == "steps" and self._spent.steps + cost > self._spent.value:
            need, left = int(self._spent.steps + cost), self._spent.value - self._spent.steps
            return best, {"ran": False, "runner_up": second["settings"], "needs_steps": cost,
                          "why": f"the budget of {self._spent.value:g} steps has {left:g} left, the confirmation "
                                 f"needs {cost}{raise_hint.format(need=need)}"}
        if self._spent.unit == "minutes" and self._spent.minutes >= self._spent.value:
            return best, {"ran": False, "runner_up": second["settings"],
                          "why": f"the budget of {self._spent.value:g} minutes is spent"
                                 f"{raise_hint.format(need='more')}"}
        chosen, rec = confirm_choice(best, trained, lambda t: self.trial(
            "confirmation", {**t["settings"], seed[0]: seed[1]}, run, steps=0, subdir=subdir, extra=extra,
            trained=False, scale=self.scales[True]), seed=seed, higher_is_better=False, cost=self.cost)
        self._note_decision(rec["decision"], extra)
        self.save()
        return chosen, rec

    def summary(self, *, raise_hint: str = "", confirmation: Mapping[str, Any] | None = None) -> dict:
        """What ran: ``{"ran": [stage names], "not_applicable": [...], "partly_skipped_for_budget": [...],
        "skipped_for_budget": [...],
        "raise": text, "resolution": text}``; ``resolution``: :func:`resolution` at the median spread of the
        paired differences the decisions saw; ``raise``: ``raise_hint`` (what to raise, in words) with ``{need}``
        the steps a budget of steps needs to run every skipped trial and a ``confirmation`` that did not run for
        the budget, absent when nothing was skipped."""
        st = self.record["stages"]
        out = {"ran": [s["stage"] for s in st if s["status"] == "ran"],
               "not_applicable": [s["stage"] for s in st if s["status"] == "not applicable"],
               "partly_skipped_for_budget": [s["stage"] for s in st if s["status"] == "partly skipped for budget"],
               "skipped_for_budget": [s["stage"] for s in st if s["status"] == "skipped for budget"]}
        paired_ = [d for d in self.record["decisions"] if d.get("paired") and d.get("se") is not None]
        if paired_:  # what the select sequences resolved, given the spread of differences the search saw
            spread = sorted(d["se"] * math.sqrt(d["n"]) for d in paired_)[len(paired_) // 2]
            out["resolution"] = resolution(paired_[0]["n"], spread)
        extra = (confirmation or {}).get("needs_steps") or 0
        if self.record["skipped"] or extra:
            need = int(self._spent.steps + extra + sum(x.get("steps") or 0 for x in self.record["skipped"])) \
                if self._spent.unit == "steps" else "more"
            out["raise"] = raise_hint.format(need=need)
        return out
