"""The options of ``kvpop train`` (its parser builder): the model and data, the method's settings, the run's
length and outputs, several processes, and ``--auto``'s (:mod:`kvpop.cli.auto`).  What the command does with
them: :mod:`kvpop.cli.train`."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpop.baselines.dms import DMSConfig
    from kvpop.core.config import LABELS, MASK_SOURCES, SCORERS, TARGET_LSES, TARGET_SOURCES, KVpopConfig
    from kvpop.core.config import PRIORITY_SOURCES as PRIORITIES
    from kvpop.training.allocation import VALID_SEQUENCES
    from kvpop.training.rundir import KEEP_MARGIN
    from kvpop.training.train import DIST_MODES, LEARNING_RATES

    d = KVpopConfig()
    dd = DMSConfig()
    p.add_argument("--method", choices=("kvpop", "dms"), default="kvpop",
                   help="kvpop: learned scorers with L_score (default); dms: the DMS baseline, per-token eviction "
                        "gates trained by the KL and a compression loss (kvpop.baselines.dms; --budget is not used)")
    src = p.add_argument_group("model and data")
    m = src.add_mutually_exclusive_group()
    m.add_argument("--model", type=str, default=None,
                   help="local model directory (from_pretrained, local files only); default: the shipped "
                        "tiny model kvpop/data/tiny_qwen3")
    m.add_argument("--tiny", action="store_true",
                   help="a built-in tiny Qwen3 (2 layers, vocab 640) with random weights")
    dat = src.add_mutually_exclusive_group()
    dat.add_argument("--data", type=str, default=None,
                     help='JSONL file, one {"input_ids": [...]} or {"text": "..."} per line')
    dat.add_argument("--task", nargs="?", const="kvtrace", default=None, choices=("kvtrace", "lookahead"),
                     help="train on a synthetic task generated on the fly: kvtrace (kvpop.demo.task, what --task alone "
                          "means) or lookahead (kvpop.demo.lookahead_task); the default --model is the task's "
                          "shipped model")
    src.add_argument("--seq-len", type=int, default=4096,
                     help="tokens per sequence: records are cut into pieces of this length (default 4096)")
    src.add_argument("--pack", action="store_true",
                     help="concatenate the records (separated by the tokenizer's EOS when known) before cutting")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=100, help="optimiser steps (default 100)")
    opt.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch and process (default 1)")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step (default 1)")
    lr = LEARNING_RATES
    opt.add_argument("--lr-model", type=float, default=None,
                     help=f"AdamW learning rate of the model (default: the method's, {lr['kvpop']['lr_model']:g} for "
                          f"kvpop and {lr['dms']['lr_model']:g} for dms)")
    opt.add_argument("--lr-scorer", type=float, default=None,
                     help=f"AdamW learning rate of the scorers and decays, or with --method dms of the DMS gates "
                          f"(default: the method's, {lr['kvpop']['lr_scorer']:g} for kvpop and "
                          f"{lr['dms']['lr_scorer']:g} for dms: the gates start at bias -gate-offset and must move "
                          f"by about that much within the schedule)")
    opt.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    opt.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping, <= 0 for none (default 1)")
    opt.add_argument("--top-k", type=int, default=256, help="teacher logits kept for the KL (default 256)")
    opt.add_argument("--loss-chunk", type=int, default=None,
                     help="positions per chunk of the fused LM head + KL (default: ~128 MiB of float32 logits)")
    opt.add_argument("--score-weight", type=float, default=1.0, help="weight of L_score (default 1)")
    opt.add_argument("--lm-weight", type=float, default=0.0,
                     help="weight of the training data's next-token NLL beside the KL to the original model "
                          "(default 0: the KL alone, which only asks the evicted model to imitate the original)")
    opt.add_argument("--no-train-model", action="store_true", help="train the scorers only (the model is frozen)")
    opt.add_argument("--seed", type=int, default=0, help="seed of the scorers, --tiny weights and data order")

    kv = p.add_argument_group("KVpop (kvpop.KVpopConfig)")
    kv.add_argument("--budget", type=int, default=None, help=f"entries per KV head B (default {d.budget})")
    kv.add_argument("--sinks", type=int, default=d.sinks, help=f"sink tokens (default {d.sinks})")
    kv.add_argument("--window", type=int, default=d.window, help=f"recent window (default {d.window})")
    kv.add_argument("--scorer", choices=SCORERS, default=None, help=f"scorer (default {d.scorer})")
    kv.add_argument("--scorer-hidden", type=int, default=None, help=f"scorer MLP width (default {d.scorer_hidden})")
    kv.add_argument("--mlstm-dim", type=int, default=None,
                    help=f"mLSTM feature width (with --scorer mlstm; default {d.mlstm_dim})")
    kv.add_argument("--mask-source", choices=MASK_SOURCES, default=None,
                    help="priorities of the training mask: scorer (the learned policy), teacher (the oracle: the "
                         "exact label itself, from the --target-source model's queries), streaming (the fixed "
                         f"sinks + window pattern) (default {d.mask_source})")
    kv.add_argument("--priority-source", choices=PRIORITIES, default=None,
                    help="where the priority comes from, in the training mask and when served: scorer (the learned "
                         "scorer) or a control that is not learned, trained with no L_score (the model fine-tuned as "
                         "under --mask-source streaming): random (the scorer at its --seed init, frozen), keynorm+ / "
                         "keynorm- (the pre-RoPE key norm), window-attention (the attention the token got while in "
                         "the window), oracle-label (the exact label: not causal, refused when decoding) "
                         f"(default {d.priority_source}; docs/DESIGN.md section 12)")
    kv.add_argument("--target-lse", choices=TARGET_LSES, default=None,
                    help=f"normaliser of the target (default {d.target_lse})")
    kv.add_argument("--target-source", choices=TARGET_SOURCES, default=None,
                    help="whose attention makes the label: student, the model being trained (its own forward, "
                         "normalised by --target-lse: the cheap sparse normaliser by default), or teacher, the frozen "
                         "original (exact: its own dense forward with the full cache, layer by layer) (default "
                         f"{d.target_source}; kvpop demo's joint retrofits use student too: it beat teacher on the "
                         "validation sequences of both demo tasks, kvpop/data/demo_results/README.md)")
    kv.add_argument("--tau", type=float, default=None, help=f"temperature of L_score (default {d.tau})")
    kv.add_argument("--tie-margin", type=float, default=None,
                    help="near-tie discount of L_score, 1 - exp(-|margin| / tie_margin); 0 switches it off "
                         f"(default {d.tie_margin})")
    kv.add_argument("--eps", type=float, default=None,
                    help=f"epsilon of the target log(eps + m), in [1e-30, 1] (default {d.eps})")
    kv.add_argument("--label", choices=LABELS, default=None,
                    help="how the target pools the attention a token gets after leaving the window: mean (the "
                         "method's), max (its strongest later reader), power (power mean, --label-power) "
                         f"(default {d.label})")
    kv.add_argument("--label-power", type=float, default=None,
                    help=f"exponent a of --label power, in [0.01, 10000]: (mean_u p^a)^(1/a) (default {d.label_power}; "
                         "refused with another --label)")
    kv.add_argument("--decay-nats", type=float, default=None,
                    help="tie the decay range to the context: gamma_min = exp(-N / --seq-len), an age penalty of "
                         "N nats over a training sequence at the range's lower end (kvpop.decay_range_for_context; "
                         "replaces --gamma-min, and --gamma-init when 0.9999 falls outside)")
    kv.add_argument("--gamma-min", type=float, default=None,
                    help=f"lower end of the learned per-head decay (default {d.gamma_min})")
    kv.add_argument("--gamma-max", type=float, default=None,
                    help=f"upper end of the learned per-head decay (default {d.gamma_max})")
    kv.add_argument("--gamma-init", type=float, default=None,
                    help=f"initial decay, strictly inside the range (default {d.gamma_init})")
    kv.add_argument("--init-scorers", type=str, default=None, metavar="FILE",
                    help="start the scorers from this scorer file (a scorer-only run's scorers.safetensors: a joint "
                         "retrofit's warm start) instead of their seeded initialisation; its scorer structure must "
                         "be this run's (kvpop.load_scorers checks it); budget and label may differ")
    hb = kv.add_mutually_exclusive_group()
    hb.add_argument("--head-budgets", type=str, default=None, metavar="FILE.json",
                    help="head-adaptive budgets (docs/DESIGN.md section 7): a JSON list (one per layer) of lists (one "
                         "budget per KV head), or an object with a \"head_budgets\" key (what --allocate writes), with "
                         "the uniform total layers x heads x --budget; copied into OUT/head_budgets.json")
    hb.add_argument("--allocate", choices=("ablation",), default=None,
                    help="head-adaptive budgets chosen before training: ablation = the validation NLL rise when one "
                         "head alone keeps no long-range slot (kvpop.core.budgets.ablation_importance, the run's label "
                         "of the model as loaded as the mask), shared at the uniform total by "
                         "kvpop.core.budgets.allocate; measured on "
                         "--valid-data (with --task: the task's validation sequences), never the training data; "
                         "budgets and importance go to OUT/head_budgets.json")
    kv.add_argument("--min-k", type=int, default=None,
                    help="with --allocate: the fewest long-range slots a head gets (default 0: a head may keep only "
                         "its sinks and window)")
    kv.add_argument("--valid-data", type=str, default=None, metavar="FILE.jsonl",
                    help="with --allocate or --auto: validation records (same format as --data, cut at --seq-len), "
                         "held out from the training file: --allocate measures each head's importance on them, "
                         "--auto scores every trial on them (with --task: the task's validation sequences)")
    kv.add_argument("--valid-sequences", type=int, default=None,
                    help=f"with --allocate or --auto: validation sequences measured (default {VALID_SEQUENCES}; with "
                         f"--allocate each head costs one forward over them, with --auto every validation of a trial "
                         f"scores them)")
    kv.add_argument("--no-balance", action="store_true",
                    help="do not balance keep/drop decisions in L_score (then several processes take "
                         "exactly the steps of one)")

    dm = p.add_argument_group(
        "DMS (--method dms, kvpop.baselines.dms.DMSConfig)",
        "DMS trains per-token eviction gates and the model (KL to the frozen original plus a compression loss "
        "whose target keep fraction falls linearly to --target-keep over --schedule-steps). Also used: --sinks, "
        "--window (the eviction delay), --lr-scorer (the gates' learning rate, default "
        f"{LEARNING_RATES['dms']['lr_scorer']:g}), --lr-model, --steps, --no-train-model; --budget and the scorer "
        "options are not. At the end the run warns when its keep fraction (mean of the last 10 steps) missed the "
        f"target by more than {KEEP_MARGIN:.0%} of it: then train longer or raise --lr-scorer. Evaluate it with "
        "kvpop eval --run OUT.")
    dm.add_argument("--target-keep", type=float, default=None,
                    help=f"keep fraction the compression loss drives the gates to (default {dd.target_keep}: "
                         f"compression ratio {1 / dd.target_keep:g})")
    dm.add_argument("--schedule-steps", type=int, default=None,
                    help="steps over which the target compression ratio rises linearly from 1 (default: --steps)")
    dm.add_argument("--gate-tau", type=float, default=None,
                    help=f"temperature of the Gumbel-sigmoid relaxation (default {dd.tau})")
    dm.add_argument("--gate-offset", type=float, default=None,
                    help=f"initial gate bias is minus this (default {dd.gate_offset}: every token kept at the start)")
    dm.add_argument("--aux-weight", type=float, default=None,
                    help=f"weight of the compression loss (default {dd.aux_weight})")

    run = p.add_argument_group("run")
    run.add_argument("--out", type=str, required=True, help="output directory (checkpoints, scorers, model)")
    run.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    run.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50; "
                                                                      "0: only at the end)")
    run.add_argument("--bf16", action="store_true", help="bf16 autocast with float32 weights (CUDA only)")
    run.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    run.add_argument("--dist", choices=DIST_MODES, default="ddp",
                     help="with several processes (torchrun): ddp or fsdp (FSDP2) (default ddp)")
    run.add_argument("--device", type=str, default=None,
                     help="device (default: cuda[:LOCAL_RANK] when available, else cpu)")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress report (a tqdm bar when stderr is a terminal, else a line every few steps)")
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: torch's own, one per core); may change on --resume")
    from kvpop.cli.writes import add_write_options

    add_write_options(run, overwrite=False)  # a finished run is never replaced: --resume continues it
    from kvpop.cli.auto import add_arguments as add_auto

    add_auto(p)
