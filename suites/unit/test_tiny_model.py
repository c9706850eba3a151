"""The fixture model's output depends on its context (an induction circuit), checked with
transformers' own Llama on CPU: the next token copies what followed an earlier occurrence
of the current one, so a wrong or missing page of KV changes the output. The same checks
on random weights of the same shapes fail (they are the checks' control)."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvgate.fixtures import tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, revision="r1")


def _model(path, *, scramble: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16,
                                                              attn_implementation="eager").eval()
    if scramble:  # the control: the same tensors, each shuffled, keep their statistics but not the circuit
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                flat = p.view(-1)
                flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    return model


def _predict(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(-1).tolist()


def _repeated(seed: int, n: int = 600) -> list[int]:
    rng = random.Random(seed)
    s = rng.sample(range(4, tiny_model.VOCAB), n)
    return [tiny_model.BOS_ID, *s, *s]


def _copy_accuracy(model, ids: list[int], n: int) -> float:
    pred = _predict(model, ids)
    # in the second copy, position n + j holds s[j-1]: its next token is s[j], which followed s[j-1] before
    hits = [pred[n + j] == ids[j + 1] for j in range(1, n)]
    return sum(hits) / len(hits)


def test_same_seed_and_revision_give_the_same_bytes_and_another_revision_other_weights(built, tmp_path):
    again = tiny_model.build_tiny_model(tmp_path / "again", seed=0, revision="r1")
    r2 = tiny_model.build_tiny_model(tmp_path / "r2", seed=0, revision="r2")

    def digest(p):
        return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()

    assert digest(again) == digest(built)
    assert digest(r2) != digest(built)


@pytest.mark.parametrize("scramble", [False, True], ids=["circuit", "control-scrambled"])
def test_layer_0_attends_to_the_previous_position(built, scramble):
    model = _model(built, scramble=scramble)
    ids = _repeated(1)
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions[0][0, 0].float()
    pos = torch.arange(1, len(ids))
    weight = att[pos, pos - 1].min().item()
    if scramble:
        assert weight < 0.5
    else:
        assert weight > 0.99


@pytest.mark.parametrize("scramble", [False, True], ids=["circuit", "control-scrambled"])
def test_the_next_token_copies_what_followed_the_earlier_occurrence(built, scramble):
    model = _model(built, scramble=scramble)
    n = 600
    acc = _copy_accuracy(model, _repeated(2, n), n)
    if scramble:
        assert acc < 0.05
    else:
        assert acc > 0.97


def test_the_output_follows_a_change_of_context_far_back(built):
    """Change what followed the earlier occurrence, 500 positions back: the prediction
    follows it. KV computed on the wrong context, or never loaded, changes the output."""
    model = _model(built)
    rng = random.Random(3)
    body = rng.sample(range(4, tiny_model.VOCAB), 700)
    trigger, after, other = body[100], body[101], body[-1]
    ids = [tiny_model.BOS_ID, *body[:600], trigger]
    assert _predict(model, ids)[-1] == after
    ids[102] = other  # what followed the trigger, far back
    assert _predict(model, ids)[-1] == other
