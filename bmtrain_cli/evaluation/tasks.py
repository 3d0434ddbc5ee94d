"""Prompts and scores: each question becomes one (context, continuation) request per choice, as
lm-evaluation-harness's multiple_choice tasks build them, and is scored by the summed log-probability of
each continuation (bmtrain_cli/models/scoring.py). ``acc``: the most likely choice is the answer;
``acc_norm``: the same after dividing each log-probability by the continuation's length in characters
(lm-eval's completion_len)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from bmtrain_cli.evaluation.layouts import LETTERS, Question, Subject
from bmtrain_cli.labels import IGNORE_INDEX

# lm-eval's task descriptions: MMLU's names the subject; C-Eval's and CMMLU's (in Chinese) name it too.
DESCRIPTIONS: Dict[str, str] = {
    "mmlu": "The following are multiple choice questions (with answers) about {subject}.\n\n",
    "ceval": "以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n",
    "cmmlu": "以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n",
    "multiple_choice": "The following are multiple choice questions (with answers) about {subject}.\n\n",
}
ANSWER_CUE = {"mmlu": "Answer:", "ceval": "答案：", "cmmlu": "答案：", "multiple_choice": "Answer:"}


def question_text(task: str, q: Question) -> str:
    """lm-eval's doc_to_text: the question, the lettered choices and the answer cue."""
    options = "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(q.choices))
    return f"{q.question.strip()}{options}\n{ANSWER_CUE[task]}"


def context(task: str, subject: Subject, q: Question, num_fewshot: int) -> str:
    """The description, the first ``num_fewshot`` dev questions answered, then the question (lm-eval's
    first_n sampler, examples joined by a blank line, target after one space)."""
    shots = [f"{question_text(task, d)} {LETTERS[d.answer]}" for d in subject.dev[:num_fewshot]]
    description = DESCRIPTIONS[task].format(subject=subject.name.replace("_", " "))
    return description + "".join(s + "\n\n" for s in shots) + question_text(task, q)


def encode_request(
    tokenizer: Any, ctx: str, continuation: str, max_len: int
) -> Tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) scoring ``continuation`` after ``ctx``: the whole text encoded, the context's
    tokens the prefix (lm-eval's _encode_pair; a BOS when the tokenizer adds one), cut on the left to
    ``max_len`` + 1 tokens, as lm-eval cuts them: the last token is only a target, so the model reads
    ``max_len``."""
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    whole = bos + list(tokenizer.encode(ctx + continuation))
    n_ctx = len(bos) + len(tokenizer.encode(ctx))
    ids = np.asarray(whole[-(max_len + 1) :], dtype=np.int64)
    labels = ids.copy()
    labels[: max(0, len(ids) - (len(whole) - n_ctx))] = IGNORE_INDEX
    return ids, labels


def build_requests(
    task: str, subjects: List[Subject], tokenizer: Any, num_fewshot: int, max_len: int
) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Every question's choices as scored samples, subject by subject, question by question."""
    out = []
    for subject in subjects:
        for q in subject.test:
            ctx = context(task, subject, q, num_fewshot)
            for i in range(len(q.choices)):
                out.append(encode_request(tokenizer, ctx, " " + LETTERS[i], max_len))
    return out


def score_subjects(subjects: List[Subject], logps: np.ndarray) -> Dict[str, Any]:
    """acc and acc_norm per subject, their mean over subjects, and over all questions (lm-eval's group
    figure, weighted by subject size)."""
    per: Dict[str, Dict[str, float]] = {}
    k = 0
    hits_all = [0.0, 0.0]
    total = 0
    for subject in subjects:
        hits = [0.0, 0.0]
        for q in subject.test:
            lls = logps[k : k + len(q.choices)]
            k += len(q.choices)
            lengths = np.array([len(" " + LETTERS[i]) for i in range(len(q.choices))], dtype=np.float64)
            hits[0] += float(int(np.argmax(lls)) == q.answer)
            hits[1] += float(int(np.argmax(lls / lengths)) == q.answer)
        n = len(subject.test)
        per[subject.name] = {"acc": hits[0] / n, "acc_norm": hits[1] / n, "questions": n}
        hits_all = [a + b for a, b in zip(hits_all, hits)]
        total += n
    return {
        "subjects": per,
        "acc": hits_all[0] / total,
        "acc_norm": hits_all[1] / total,
        "acc_subject_mean": float(np.mean([v["acc"] for v in per.values()])),
        "questions": total,
    }


def evaluate(
    task: str,
    subjects: List[Subject],
    model: Any,
    tokenizer: Any,
    num_fewshot: int,
    max_len: int,
    batch_size: int,
    on_batch: Optional[Callable[[int], None]] = None,
) -> Tuple[Dict[str, Any], int]:
    """(scores, number of requests) of ``model`` on ``subjects``."""
    from bmtrain_cli.models.scoring import sample_logps

    samples = build_requests(task, subjects, tokenizer, num_fewshot, max_len)
    logps = sample_logps(model, samples, batch_size, on_batch)
    return score_subjects(subjects, logps), len(samples)
