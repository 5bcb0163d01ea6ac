"""Accuracy of generated answers per policy and budget (``kvpop eval --problems FILE.jsonl``).

Every problem (:mod:`~kvpop.answers.records`: a prompt and its accepted answers) is answered ``samples`` times
under every policy and budget, dense included, by batched generation through the policy's cache
(:mod:`~kvpop.answers.generation`, or vLLM with kvpop's plugin: :mod:`~kvpop.answers.vllm_engine`), scored
(:mod:`~kvpop.answers.scoring`: pass@1, maj@N, pass@N), logged per problem so that a long run resumes
(:mod:`~kvpop.answers.resume`), summed up per policy and budget (:mod:`~kvpop.answers.measure`) and written as
``results.json``, ``table.md``, ``generations.jsonl`` and ``accuracy_vs_budget.png``
(:mod:`~kvpop.answers.report`).  The policies are named in :mod:`kvpop.policies`.
"""
from .generation import generate_rows, row_seed
from .measure import ProblemsConfig, evaluate_problems, results_dict
from .records import Problem, check_lengths, model_context, read_problems
from .report import finish_problems, format_problems_table, generations, plot_problems
from .resume import RESULTS_LOG, SETTINGS, append_row, load_log, open_log, row_key
from .scoring import EXTRACT_RULES, check_rule, extract, is_correct, sample_metrics
from .vllm_engine import VLLM_POLICIES, VLLMEngine, VLLMModel, vllm_overrides

__all__ = ["Problem", "ProblemsConfig", "EXTRACT_RULES", "read_problems", "model_context", "check_lengths",
           "extract", "is_correct", "check_rule", "sample_metrics", "row_seed", "generate_rows", "evaluate_problems",
           "results_dict", "RESULTS_LOG", "SETTINGS", "row_key", "load_log", "open_log", "append_row", "generations",
           "format_problems_table", "plot_problems", "finish_problems", "VLLM_POLICIES", "VLLMModel", "VLLMEngine",
           "vllm_overrides"]
