"""Pooling models (`--runner pooling`) against sentence-transformers and transformers on tiny
random checkpoints: a Qwen3-Embedding-shaped sentence-transformers embedder through a real
`launch` and the openai SDK, a Qwen3ForSequenceClassification cross-encoder, a Qwen3-Reranker-style
yes/no classifier, BERT and XLM-RoBERTa encoders through `LLM`; batches of mixed lengths, chunked
prefill (a token budget smaller than the long prompts)."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from pooling_models import make_bert_embedder, make_classifier, make_embedder, make_xlmr_reranker
from prometheus_client.parser import text_string_to_metric_families
from test_server import Launched, launch_args

from pagedserve import LLM

from tiny_models import tiny_model_dir

# eager: no CPU forward compiling in the background of a short test
CPU = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
           enforce_eager=True)  # fmt: skip
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then the dog jumps back " * 3,
    "Once upon a time there was a little town",
    "a b",
]
DOCS = ["the fox and the dog", "Once upon a time", "Hello there, how are you", "town"]


def _cos(a, b) -> float:
    return F.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0).item()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_embedder(str(tmp_path_factory.getbasetemp() / "tiny-st-embedder"))


@pytest.fixture(scope="module")
def st_reference(embedder: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(embedder, device="cpu")
    return lambda texts: model.encode(texts, batch_size=1, convert_to_tensor=True)


@pytest.fixture(scope="module")
def server(embedder: str, tmp_path_factory: pytest.TempPathFactory):
    args = launch_args(embedder, "--served-model-name", "emb", "--max-model-len", "128",
                       "--max-num-batched-tokens", "32", "--enforce-eager")  # fmt: skip
    proc = Launched(args, str(tmp_path_factory.mktemp("pool") / "launch.log"))
    url = proc.wait_ready()
    yield url
    assert proc.stop() == 0, proc.output()


def test_openai_embeddings(server: str, st_reference) -> None:
    """openai SDK: a list of strings (base64, the SDK's default), token ids, float."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="x")
    ref = st_reference(TEXTS)
    got = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for d, r in zip(got.data, ref, strict=True):
        assert _cos(d.embedding, r) >= 0.9999
        assert abs(torch.tensor(d.embedding).norm().item() - 1) < 1e-4
    ids = client.embeddings.create(model="emb", input=[[5, 6, 7]], encoding_format="float")
    tok = httpx.post(server + "/tokenize", json={"prompt": TEXTS[2]}).json()["tokens"]
    one = client.embeddings.create(model="emb", input=tok, encoding_format="float")
    assert _cos(one.data[0].embedding, ref[2]) >= 0.9999
    assert one.usage.prompt_tokens == len(tok) and ids.usage.prompt_tokens == 3


def _counts(server: str) -> dict[str, float]:
    """Counter and histogram-count samples of /metrics, by name and finished_reason."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server + "/metrics").text):
        for sample in family.samples:
            key = sample.name + sample.labels.get("finished_reason", "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def test_embeddings_are_counted_in_metrics(server: str) -> None:
    """Pooling requests count as vLLM counts them: prompt tokens, one success each, queue
    and end-to-end latency; no generated tokens."""
    before = _counts(server)
    got = httpx.post(server + "/v1/embeddings", json={"model": "emb", "input": TEXTS}).json()
    after = _counts(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pagedserve:prompt_tokens_total") == got["usage"]["prompt_tokens"]
    assert delta("pagedserve:generation_tokens_total") == 0
    assert delta("pagedserve:request_success_totalstop") == len(TEXTS)
    for hist in ("e2e_request_latency", "request_queue_time", "time_to_first_token"):
        assert delta(f"pagedserve:{hist}_seconds_count") == len(TEXTS)


def test_dimensions_truncate_base64(server: str) -> None:
    """Matryoshka `dimensions` (cut, then normalized) of the last 5 tokens, as base64."""
    body = {"model": "emb", "input": TEXTS[1], "dimensions": 16, "encoding_format": "base64",
            "truncate_prompt_tokens": 5}  # fmt: skip
    r = httpx.post(server + "/v1/embeddings", json=body).json()
    vec = struct.unpack("<16f", base64.b64decode(r["data"][0]["embedding"]))
    tok = httpx.post(server + "/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    full = httpx.post(
        server + "/v1/embeddings", json={"model": "emb", "input": [tok[-5:]], "normalize": False}
    ).json()
    ref = F.normalize(torch.tensor(full["data"][0]["embedding"][:16]), dim=0)
    assert r["usage"]["prompt_tokens"] == 5
    assert _cos(vec, ref) >= 0.9999


def test_refusals(server: str) -> None:
    """Generation on a pooling model and unimplemented fields: 400s that name them."""
    r = httpx.post(server + "/v1/completions", json={"model": "emb", "prompt": "hi"})
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/embeddings", json={"input": "hi", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server + "/classify", json={"input": "hi"})
    assert r.status_code == 400 and "task is embed" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/embeddings", json={"input": [list(range(200))]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_score_and_rerank_embedder(server: str, st_reference) -> None:
    """An embed model scores by cosine; /v1/rerank sorts and cuts to top_n."""
    ref = st_reference(["a query", *DOCS])
    want = [_cos(ref[0], d) for d in ref[1:]]
    r = httpx.post(server + "/score", json={"text_1": "a query", "text_2": DOCS}).json()
    assert all(abs(d["score"] - w) < 1e-4 for d, w in zip(r["data"], want, strict=True))
    body = {"query": "a query", "documents": DOCS, "top_n": 2}
    for path in ("/rerank", "/v1/rerank"):
        res = httpx.post(server + path, json=body).json()["results"]
        order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in res] == order
        assert res[0]["document"]["text"] == DOCS[order[0]]
    pooled = httpx.post(server + "/pooling", json={"input": "Hello"}).json()
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 64


def test_classifier_and_rerank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A *ForSequenceClassification cross-encoder: softmax probs, and score order."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_classifier(str(tmp_path_factory.getbasetemp() / "tiny-classifier"))
    ref = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([ids])).logits[0].softmax(-1)

    with LLM(path, **CPU) as llm:
        outs = llm.classify(TEXTS)
        pairs = [tok("a query", d)["input_ids"] for d in DOCS]  # the pair encoding
        scores = [s.outputs.score for s in llm.score("a query", DOCS)]
    for text, out in zip(TEXTS, outs, strict=True):
        assert torch.allclose(torch.tensor(out.outputs.probs), probs(tok(text)["input_ids"]),
                              atol=1e-5)  # fmt: skip
    want = [probs(ids)[1].item() for ids in pairs]
    assert sorted(range(4), key=lambda i: -scores[i]) == sorted(range(4), key=lambda i: -want[i])
    assert all(abs(s - w) < 1e-5 for s, w in zip(scores, want, strict=True))


def test_yes_no_reranker(embedder: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A decoder reranker's sigmoid(yes - no) of its LM head (Qwen3-Reranker:
    classifier_from_token); MEAN and CLS over chunks: test_pooling_core.py."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedder)
    causal = tiny_model_dir("qwen3", tmp_path_factory.getbasetemp())
    no, yes = tok.convert_ids_to_tokens([300, 301])
    config = {"classifier_from_token": [no, yes]}
    lm = AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32).eval()
    with LLM(causal, runner="pooling", pooler_config=config, **CPU) as llm:
        scores = [s.outputs.score for s in llm.score("a query", DOCS)]
    for doc, score in zip(DOCS, scores, strict=True):
        ids = tok("a query", doc)["input_ids"]
        with torch.no_grad():
            logits = lm(torch.tensor([ids])).logits[0, -1]
        assert abs(score - torch.sigmoid(logits[301] - logits[300]).item()) < 1e-5


def test_encoders(tmp_path_factory: pytest.TempPathFactory) -> None:
    """BERT (all-MiniLM's shape: mean pooling, normalized) against sentence-transformers, and an
    XLM-RoBERTa cross-encoder (bge-reranker's shape, one label: sigmoid) against transformers:
    bidirectional attention over whole prompts of mixed lengths, no KV cache."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = tmp_path_factory.getbasetemp()
    bert = make_bert_embedder(str(base / "tiny-bert-st"))
    ref = SentenceTransformer(bert, device="cpu").encode(TEXTS, convert_to_tensor=True)
    with LLM(bert, **CPU) as llm:
        outs = llm.embed(TEXTS[:1] + TEXTS[2:])
        with pytest.raises(ValueError, match="whole in one step"):
            llm.embed(TEXTS[1])  # longer than the token budget: an encoder does not chunk
    for want, out in zip([ref[0], *ref[2:]], outs, strict=True):
        assert _cos(out.outputs.embedding, want) >= 0.9999

    xlmr = make_xlmr_reranker(str(base / "tiny-xlmr-reranker"))
    model = AutoModelForSequenceClassification.from_pretrained(xlmr, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(xlmr)
    with torch.no_grad():
        want = [torch.sigmoid(model(**tok("a query", d, return_tensors="pt")).logits[0, 0]).item()
                for d in DOCS]  # fmt: skip
    with LLM(xlmr, **CPU) as llm:
        scores = [s.outputs.score for s in llm.score("a query", DOCS)]
    assert all(abs(s - w) < 1e-5 for s, w in zip(scores, want, strict=True)), (scores, want)
    assert sorted(range(4), key=lambda i: -scores[i]) == sorted(range(4), key=lambda i: -want[i])
