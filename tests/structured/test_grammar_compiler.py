"""GrammarCompiler and TokenBitmask on the tiny checkpoint's tokenizer (375 tokens in a
384-row vocabulary: the 9 padding rows must never be allowed)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvrecover.structured.bitmask import TokenBitmask
from kvrecover.structured.compiler import GrammarCompiler, load_xgrammar
from kvrecover.structured.params import StructuredOutputsParams as Spec

VOCAB = 384
EOS = 1


@pytest.fixture(scope="module")
def compiler(tiny_llama) -> GrammarCompiler:
    return GrammarCompiler(tiny_llama, VOCAB, [EOS])


def allowed_ids(compiler: GrammarCompiler, spec: Spec) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    TokenBitmask(torch.device("cpu")).apply(logits, [compiler.matcher(spec)])
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_padding_rows_and_eos_are_banned_until_the_grammar_allows_them(compiler, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer_size = len(AutoTokenizer.from_pretrained(str(tiny_llama)))
    assert tokenizer_size < VOCAB
    allowed = allowed_ids(compiler, Spec(regex="[a-z ]+"))
    assert allowed and max(allowed) < tokenizer_size and EOS not in allowed
    state = compiler.matcher(Spec(choice=["a"]))
    token = next(iter(allowed_ids(compiler, Spec(choice=["a"]))))
    assert state.accept(token)
    logits = torch.zeros(1, VOCAB)
    TokenBitmask(torch.device("cpu")).apply(logits, [state])
    assert torch.nonzero(torch.isfinite(logits[0])).flatten().tolist() == [EOS]
    assert state.accept(EOS) and state.is_terminated


def test_both_kernels_equal_xgrammars_own_and_leave_other_rows_alone(compiler):
    xgr = load_xgrammar()
    states = [compiler.matcher(Spec(json={"type": "object"})), None,
              compiler.matcher(Spec(regex="[0-9]{2}"))]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    ours = logits.clone()
    TokenBitmask(torch.device("cpu")).apply(ours, states)
    in_torch = logits.clone()  # the kernel a GPU runs
    TokenBitmask(torch.device("cpu"), use_torch=True).apply(in_torch, states)
    assert torch.equal(in_torch, ours)
    theirs = logits.clone()
    bitmask = xgr.allocate_token_bitmask(3, VOCAB)
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 2])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1])


@pytest.mark.parametrize("spec, message", [
    (Spec(regex="(ab"), "structured_outputs.regex does not compile: .*parenthesis"),
    (Spec(json={"type": 5}), "structured_outputs.json does not compile: .*string"),
    (Spec(json="{not json"), "structured_outputs.json does not compile"),
    (Spec(grammar='root ::= "a" |'), "structured_outputs.grammar does not compile: .*EBNF"),
    (Spec(grammar='start ::= "a"'), "structured_outputs.grammar does not compile"),
])
def test_a_spec_that_does_not_compile_is_a_value_error(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_by_spec(compiler):
    first = compiler.compile(Spec(json={"type": "object", "required": []}))
    again = compiler.compile(Spec(json={"required": [], "type": "object"}))
    assert first is again


def test_without_xgrammar_the_error_says_how_to_install_it(monkeypatch, tiny_llama):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ValueError, match="pip install --no-deps xgrammar==0.2.9"):
        GrammarCompiler(tiny_llama, VOCAB, [EOS])
