"""What a profile records of a model's vocabulary layers (`vocab_facts`, `meta.extra["vocab"]`): the embedding and
head of a GPT in its first and last units, and one line saying why not for a model without them or with them
elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.data.vocab import vocab_refusal, vocab_tied
from autopp.model.contract import load_model_file
from autopp.model.meta import build_units
from autopp.model.vocab import vocab_facts

MODELS = Path(__file__).parent.parent / "models"


def test_a_gpt_records_its_embedding_and_head() -> None:
    mf = load_model_file(MODELS / "vocabgpt.py")
    facts = vocab_facts(mf, ["tok_emb", "pos_emb"], ["ln_f", "head"])
    assert facts == {"embedding": "tok_emb", "head": "head", "vocab": 256, "hidden": 16, "tied": False}
    assert vocab_refusal({"vocab": facts}) is None
    assert not vocab_tied({"vocab": facts}) and vocab_tied({"vocab": {**facts, "tied": True}}) and not vocab_tied({})
    hf = vocab_refusal({"vocab": facts, "hf_config": {"seq_len": 8, "task": "causal-lm"}})
    assert hf == "vocabulary parallelism: `autopp run` does not run it for a model built from an HF config yet"


def test_the_profilers_units_hold_them_at_the_ends() -> None:
    mf = load_model_file(MODELS / "vocabgpt.py")
    units = build_units(mf)[1]
    assert "embedding" in vocab_facts(mf, units[0].modules, units[-1].modules)


def test_refusals_are_recorded_in_one_line() -> None:
    facts = vocab_facts(load_model_file(MODELS / "linrelu.py"), ["0"], ["2"])
    why = vocab_refusal({"vocab": facts})
    assert why is not None and why.startswith("vocabulary parallelism needs an nn.Embedding as the model's first call")
    moved = vocab_facts(load_model_file(MODELS / "vocabgpt.py"), ["tok_emb"], ["h.3"])
    assert moved == {"refused": "vocabulary parallelism needs 'head' in the last unit, whose modules are ['h.3']"}
    assert vocab_refusal({}) == ("the profile does not record the model's vocabulary layers (made before autopp "
                                 "checked them): profile again")


@pytest.mark.integration
def test_a_model_that_reads_its_token_ids_before_the_embedding_is_refused() -> None:
    """A tester: GPT-2 planned vocab-2 (--vocab auto), then its run failed tracing the body, whose input is the
    embedded tokens: GPT-2 makes its position ids from the ids' shape before the embedding. The profile now records
    why not, and the planner never offers it."""
    from autopp.model.hf import load_model
    examples = Path(__file__).parents[2] / "examples"
    mf = load_model(examples / "hf_gpt2.py")
    units = build_units(mf)[1]
    why = vocab_refusal({"vocab": vocab_facts(mf, units[0].modules, units[-1].modules)})
    assert why is not None and why.startswith("vocabulary parallelism feeds the model the embedded tokens in place "
                                              "of their ids, and its forward does not take them (")
    assert why.endswith("): it reads the ids before its embedding (as GPT-2's position ids do)")
    llama = load_model(examples / "hf_llama.py")
    units = build_units(llama)[1]
    assert "embedding" in vocab_facts(llama, units[0].modules, units[-1].modules)
