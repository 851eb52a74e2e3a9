"""The workers' xgrammar tokenizer (worker/grammar.py `tokenizer_info`): a plain fast tokenizer
loads through its own class, not AutoTokenizer (which imports the model's config classes first:
seconds of a server's first grammar), and gives xgrammar the same vocabulary; others still go
through AutoTokenizer."""

from __future__ import annotations

import json
import shutil

import transformers

from pagedserve.frontend.hub import default_model_dir
from pagedserve.worker.grammar import tokenizer_info


def test_a_plain_fast_tokenizer_skips_auto_tokenizer(tmp_path, monkeypatch) -> None:
    real, calls = transformers.AutoTokenizer.from_pretrained, []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    got = tokenizer_info(default_model_dir(), 10**9)
    assert calls == []
    # The same tokenizer with no class named: AutoTokenizer decides, and xgrammar sees the same.
    other = tmp_path / "model"
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_dir()}/{name}", other / name)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = None
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    auto = tokenizer_info(str(other), 10**9)
    assert len(calls) == 1
    assert got.decoded_vocab == auto.decoded_vocab and got.vocab_size == auto.vocab_size == 4096
    assert got.stop_token_ids == auto.stop_token_ids and got.vocab_type == auto.vocab_type
