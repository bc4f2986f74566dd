"""Scoring an output against a reference: ROUGE-1 for a summary, WER for a transcript."""

from __future__ import annotations

from specviz.runs.settings import TEXT


def score(task: str, reference: str, output: str) -> tuple[str, float]:
    """(the metric's name, its value): 'rouge1' (F-measure, stemmed) for text, 'wer' for speech."""
    if task == TEXT:
        from rouge_score import rouge_scorer

        return "rouge1", rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True).score(reference, output)["rouge1"].fmeasure
    from specviz.speech.asr import word_error_rate

    return "wer", word_error_rate(reference, output)
