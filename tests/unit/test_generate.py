"""`plm generate`: the KV cache (and Transformer-XL's memory) give exactly what
recomputing the whole past gives; sampling is seeded, respects top-k / top-p, and
stops at max_new_tokens or the end-of-document token; bad input is a clear error."""

import pytest
import torch
from conftest import plm

from pipeline.errors import ConfigError
from pipeline.generate import (
    KVCache,
    filter_logits,
    generate,
    generate_text,
    kv_forward,
    next_token,
)
from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import save_bundle

VOCAB = 100
PRESETS = {"gpt": "gpt-tiny", "gpt2": "gpt2-tiny", "transformer-xl": "transformer-xl-tiny"}


def tiny(arch: str, vocab: int = VOCAB, **overrides):
    cfg = resolve_model_config({"arch": arch, "preset": PRESETS[arch], **overrides}, vocab)
    torch.manual_seed(0)
    return build_model(arch, cfg).eval()


def context(n=6, seed=3):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["gpt", "gpt2"])
def test_kv_cache_logits_equal_a_full_forward(arch):
    model = tiny(arch)
    x = torch.tensor([context(12)])
    full = model(x)["logits"]
    cache = KVCache.empty(len(model.blocks))
    parts = [kv_forward(model, x[:, :5], cache)]  # a prompt, then chunks and single tokens
    parts += [kv_forward(model, x[:, 5:7], cache)]
    parts += [kv_forward(model, x[:, t : t + 1], cache) for t in range(7, 12)]
    assert cache.length == 12 and cache.keys[0].shape[2] == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gpt", "gpt2", "transformer-xl"])
def test_cached_greedy_equals_uncached_greedy(arch):
    model = tiny(arch)
    cached = generate(model, context(), 20, eod_id=None, temperature=0, use_cache=True)
    uncached = generate(model, context(), 20, eod_id=None, temperature=0, use_cache=False)
    assert len(cached.tokens) == 20 and not cached.stopped_at_eod
    assert cached.tokens == uncached.tokens
    # random weights tend to repeat one token greedily: sampling walks varied contexts
    kw = {"eod_id": None, "temperature": 1.0, "seed": 5}
    sampled = generate(model, context(), 20, use_cache=True, **kw).tokens
    assert sampled == generate(model, context(), 20, use_cache=False, **kw).tokens
    assert len(set(sampled)) > 5


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny("gpt2")
    run = lambda **kw: generate(model, context(), 15, eod_id=None, **kw).tokens  # noqa: E731
    assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)
    assert run(temperature=1.0, seed=7) != run(temperature=1.0, seed=8)
    assert run(temperature=1.0, top_k=1, seed=9) == run(temperature=0)
    # sampled with the cache == sampled without (same logits, same generator draws)
    assert run(temperature=0.8, top_p=0.9, seed=3) == run(
        temperature=0.8, top_p=0.9, seed=3, use_cache=False
    )


def test_top_k_draws_only_the_k_most_likely():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    g = torch.Generator().manual_seed(0)
    draws = {int(next_token(logits, 1.0, 3, 1.0, g)[0]) for _ in range(300)}
    assert draws == top3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()

    def kept(p):
        return set(torch.isfinite(filter_logits(logits, 0, p))[0].nonzero()[:, 0].tolist())

    assert kept(0.3) == {1}
    assert kept(0.75) == {1, 3}
    assert kept(0.9) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    g = torch.Generator().manual_seed(0)
    draws = {int(next_token(logits, 1.0, 0, 0.75, g)[0]) for _ in range(200)}
    assert draws == {1, 3}
    # top-k and top-p together: the stricter wins
    assert set(torch.isfinite(filter_logits(logits, 1, 0.9))[0].nonzero()[:, 0].tolist()) == {1}


def test_stops_at_max_new_tokens_and_at_eod():
    model = tiny("gpt")
    greedy = generate(model, context(), 8, eod_id=None, temperature=0).tokens
    assert len(greedy) == 8
    eod = greedy[3]
    first = greedy.index(eod)
    stopped = generate(model, context(), 8, eod_id=eod, temperature=0)
    assert stopped.stopped_at_eod and stopped.tokens == greedy[:first]
    assert generate(model, context(), 0, eod_id=None).tokens == []


def test_bad_settings_are_clear_errors():
    model = tiny("gpt2", max_positions=16)
    with pytest.raises(ValueError, match="max_positions 16"):
        generate(model, context(10), 10, eod_id=None)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, context(), 5, eod_id=None, top_p=0.0)
    # transformer-xl has no position limit: its memory bounds the context instead
    assert len(generate(tiny("transformer-xl"), context(10), 30, None, 0).tokens) == 30


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("gen_tok")
    corpus = root / "corpus.txt"
    corpus.write_text("the cat reads the book today.\n\na dog sees a tree again.\n" * 30)
    return train_tokenizer([str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=120), root)


def make_bundle(tmp_path, tok_dir, arch):
    import json

    vocab = json.loads((tok_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    model = tiny(arch, vocab)
    cfg = model.config
    return save_bundle(tmp_path / arch, arch, cfg, model.state_dict(), tok_dir)


@pytest.mark.slow  # two CLI subprocesses
def test_generate_text_from_a_bundle_and_the_cli(tmp_path, tok_dir):
    bundle = make_bundle(tmp_path, tok_dir, "transformer-xl")
    out = generate_text(str(bundle), "the cat", max_new_tokens=6, temperature=0)
    assert out["arch"] == "transformer-xl" and out["prompt_ids"]
    assert out["text"].startswith("the cat")
    assert len(out["tokens"]) == 6 or out["stopped_at_eod"]
    again = generate_text(str(bundle), "the cat", max_new_tokens=6, temperature=0, use_cache=False)
    assert again["tokens"] == out["tokens"]

    proc = plm("generate", str(bundle), "--prompt", "the cat", "--max-new-tokens", "6",
               "--temperature", "0", cwd=tmp_path)  # fmt: skip
    assert proc.stdout.strip() == out["text"]
    bad = plm("generate", str(tmp_path / "nope"), "--prompt", "x", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "is not a model bundle" in bad.stderr
    bad = plm("generate", str(bundle), "--prompt", "x", "--top-p", "2", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "top_p" in bad.stderr


@pytest.mark.slow  # creates an MLflow sqlite store
def test_encoders_and_unknown_mlflow_models_are_refused(tmp_path, tok_dir):
    import json

    vocab = json.loads((tok_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, vocab)
    bert = save_bundle(
        tmp_path / "bert", "bert", cfg, build_model("bert", cfg).state_dict(), tok_dir
    )
    with pytest.raises(ConfigError, match="not a left-to-right language model"):
        generate_text(str(bert), "the cat", max_new_tokens=2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(
        ConfigError, match="cannot fetch .models:/no-such-model@current. from MLflow at sqlite"
    ):
        generate_text("models:/no-such-model@current", "x", tracking_uri=uri)


@pytest.mark.parametrize(
    "tokens,pieces,completion,eod,said",
    [([7, 7, 7], ["Ċ", "Ċ", "Ċ"], "\n\n\n", False, "3 tokens that decode to whitespace only: 'Ċ' (id 7)"),
     ([], [], "", True, "the first token drawn was the end-of-text token"),
     ([9, 4], ["Ġ", "Ċ"], " \n", True, "whitespace only then the end-of-text token"),
     ([5], ["cat"], " cat", False, None)],
)  # fmt: skip
def test_a_completion_that_shows_as_nothing_is_explained(
    monkeypatch, capsys, tokens, pieces, completion, eod, said
):
    """`--temperature 0` on a tiny GPT-2 printed the prompt and blank lines: a completion
    with nothing visible gets a line on stderr saying what was generated."""
    import argparse

    import pipeline.generate as gen

    def fake(*args, **kwargs):
        return {"arch": "gpt2", "pieces": pieces, "prompt_ids": [1], "tokens": tokens,
                "stopped_at_eod": eod, "completion": completion, "text": "the" + completion}  # fmt: skip

    monkeypatch.setattr(gen, "generate_text", fake)
    args = argparse.Namespace(model="m", prompt="the", max_new_tokens=3, temperature=0.0,
                              top_k=0, top_p=1.0, seed=0, tracking_uri=None, no_cache=False)  # fmt: skip
    assert gen.generate_from_cli(args) == 0
    captured = capsys.readouterr()
    assert captured.out == "the" + completion + "\n"
    if said is None:
        assert captured.err == ""
    else:
        assert captured.err.startswith("plm generate: ") and said in captured.err
