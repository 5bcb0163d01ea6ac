"""``kvpop eval --problems FILE.jsonl``: accuracy of generated answers per policy and budget
(:mod:`kvpop.answers`).

The policies come from the same ``--run`` / ``--scorers`` / ``--finetuned`` / ``--dms`` options as the rest of
``kvpop eval`` (:func:`kvpop.cli.eval._trained`, :func:`kvpop.cli.trained.policy_models`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from kvpop.policies import JOINT, POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generated answers (--problems)")
    g.add_argument("--problems", default=None, metavar="JSONL",
                   help='problems: JSONL of {"prompt": "..."} or {"prompt_ids": [...]} with "answer" (a string or a '
                        'list of accepted strings) or "answer_ids", optional "id"; each is answered --samples times '
                        "under every policy and budget (pass@1, maj@N, pass@N, generated length, peak cache bytes)")
    g.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                   help="hf (default): batched transformers generate through the policies' caches; vllm: the kvpop "
                        "vLLM plugin (needs vllm installed)")
    g.add_argument("--samples", type=int, default=1, help="samples per problem (default 1)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each problem and sample draws from its own generator seeded by it (default 0)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated at most per answer (default: the longest answer_ids when every record has "
                        "them, else 512, at most the model's context less the longest prompt); a prompt and its "
                        "answer must fit the context (max_position_embeddings)")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap text prompts in the model's chat template (one user turn, generation prompt added)")
    g.add_argument("--extract", default="last-number",
                   help="how a text answer is read from the generation: last-number (default), boxed (\\boxed{...}), "
                        "regex:PATTERN (the last match, its first group if any), exact (the whole text)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences generated together (default 8; dms: 1)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out (its problems.jsonl), skipping the problems already answered")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _ConfigOnly:
    """A model's config and generation config without its weights (what --engine vllm needs here)."""

    def __init__(self, config) -> None:
        self.config = config


def _vllm_models(P, model_dir: Path, policies, wanted, trained: dict) -> dict:
    """policy -> :class:`kvpop.answers.VLLMModel` for every policy the plugin serves that has what it
    needs (a policy named in ``wanted`` without it raises ValueError)."""
    out = {"dense": P.VLLMModel(str(model_dir))}
    for p in policies:
        if p == "dense" or p not in P.VLLM_POLICIES:
            continue
        t = trained.get(p)
        if p == "streaming":
            out[p] = P.VLLMModel(str(model_dir), "streaming")
        elif p == "fixed-finetune":
            if t is None or t.model is None:
                if wanted is not None:
                    raise ValueError("policy 'fixed-finetune' needs a fine-tuned model: --run fixed-finetune=DIR")
                continue
            out[p] = P.VLLMModel(str(t.model), "streaming")
        else:
            if t is None or t.scorers is None:
                if wanted is not None:
                    raise ValueError(f"policy {p!r} needs its scorers: --run {p}=DIR or --scorers {p}=FILE")
                continue
            if p in JOINT and t.model is None:
                raise ValueError(f"policy {p!r} needs the model trained with its scorers: --run {p}=DIR")
            # head-adaptive budgets: the plugin serves the scorer file's rows in its packed layout (another budget
            # shares their total by the run's head_budgets.json, kvpop.vllm.settings; checked before any work)
            out[p] = P.VLLMModel(str(t.model if t.model is not None else model_dir), "kvpop", str(t.scorers))
    return out


def run(args: argparse.Namespace, trained: dict, wanted: list[str] | None) -> int:
    import torch

    from kvpop import answers as P
    from kvpop.evaluation import evaluate as E
    from kvpop.evaluation import trace_eval as TE
    from kvpop.training import data as data_io

    from .trained import parse_ints as _ints
    from .trained import policy_models as _policy_models
    from .trained import run_settings as _settings
    from .trained import with_named

    t0 = time.time()
    try:
        for name in ("lengths", "train_len", "n_sequences", "data", "seq_len"):
            if getattr(args, name, None) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is not for --problems")
        if wanted is not None and "dms-test-calibrated" in wanted:
            raise ValueError("dms-test-calibrated is not a --problems policy: here dms sets its gate threshold on each "
                             "prompt (what inference sees), never on the answer; ask for dms")
        if args.resume and args.out is None:
            raise ValueError("--resume needs --out (the directory of the run to continue)")
        engine = None
        if args.engine == "vllm":
            bad = [p for p in wanted or [] if p not in P.VLLM_POLICIES]
            if bad:
                raise ValueError(f"--engine vllm serves {list(P.VLLM_POLICIES)} (the kvpop.vllm plugin's cache "
                                 f"policies and dense), not {bad}; use --engine hf for them")
            engine = P.VLLMEngine(sinks=0, window=1)  # raises when vLLM is not installed; settings below
        sinks, window, summary = _settings(args, trained, wanted)
        budgets = _ints(args.budgets) or E.budgets_for(2048)
        path = Path(args.problems)
        model_dir = Path(args.model) if args.model is not None else E.SHIPPED_MODEL
        if engine is not None:
            from transformers import AutoConfig, GenerationConfig

            engine.sinks, engine.window = sinks, window
            base = _ConfigOnly(AutoConfig.from_pretrained(str(model_dir), local_files_only=True))
            try:
                base.generation_config = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
            except OSError:
                base.generation_config = GenerationConfig()
        else:
            base = TE.load_model(args.model) if args.model is not None else E.load_base_model()
        tok_holder: dict = {}

        def tokenizer():
            if "tok" not in tok_holder:
                try:
                    tok_holder["tok"] = data_io.load_tokenizer(model_dir)
                except ValueError:
                    tok_holder["tok"] = None
            return tok_holder["tok"]

        problems = P.read_problems(path, vocab_size=base.config.vocab_size, tokenizer=tokenizer,
                                   tokenizer_source=f"the model directory {model_dir}",
                                   chat_template=args.chat_template)
        context = P.model_context(base.config)
        max_new = args.max_new_tokens
        if max_new is None:
            max_new = (max(len(p.answer_ids) for p in problems)
                       if all(p.answer_ids is not None for p in problems) else 512)
            if context is not None:  # the default stays inside the context with the longest prompt
                max_new = max(1, min(max_new, context - max(len(p.prompt_ids) for p in problems)))
        elif max_new < 1:
            raise ValueError(f"--max-new-tokens must be an int >= 1, got {max_new}")
        P.check_lengths(problems, max_new, context, model=f"the model {model_dir}")
        if engine is not None and any(t.name is not None for t in trained.values()):
            raise ValueError("--engine vllm serves one run per policy: named runs (--run NAME=DIR) are for --engine hf")
        cfg = P.ProblemsConfig(budgets=budgets, policies=with_named(wanted or list(POLICIES), trained, wanted),
                               samples=args.samples,
                               temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_new_tokens=max_new,
                               extract=args.extract, batch_size=args.batch_size, sinks=sinks, window=window,
                               progress=not args.no_progress, problems_file=str(path),
                               problems_sha256=_sha256(path),
                               extra={"model": str(model_dir), "chat_template": bool(args.chat_template),
                                      "trained": summary, "engine": args.engine})
        if engine is not None:
            models = _vllm_models(P, model_dir, cfg.policies, wanted, trained)
        else:
            models = _policy_models(E, base, cfg.policies, wanted, trained, sinks=sinks, window=window,
                                    budget=cfg.budgets[0] if cfg.budgets else sinks + window + 1,
                                    load=TE.load_model, budgets=cfg.budgets)
        tok = tokenizer() if any(p.answers is not None for p in problems) else None
        gc = base.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else base.config.eos_token_id
        pad = gc.pad_token_id if gc.pad_token_id is not None else (base.config.pad_token_id or 0)
        results = P.evaluate_problems(models, problems, cfg,
                                      decode=(lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok else None,
                                      eos_token_id=eos, pad_token_id=pad, out=args.out, resume=args.resume,
                                      engine=engine)
        if engine is not None:
            engine.close()
        if getattr(args, "_row_models", None):
            from .trained import rows_ran

            results["row_models"] = rows_ran(args._row_models, [r["policy"] for r in results.get("rows", [])])
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvpop eval: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    table = P.finish_problems(results, out, not args.no_plot)
    print(table)
    if results.get("row_models"):
        from .trained import models_line

        print(models_line(results["row_models"]))
    if out is not None:
        (out / "run.json").write_text(json.dumps({"eval_seconds": round(time.time() - t0, 1),
                                                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                  "argv": sys.argv[1:], "threads": torch.get_num_threads()},
                                                 indent=1) + "\n")
        print(f"wrote {out / 'results.json'}, table.md, generations.jsonl" +
              ("" if args.no_plot else ", accuracy_vs_budget.png"))
    return 0
