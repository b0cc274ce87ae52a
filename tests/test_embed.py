"""Embeddings and rerank (runtime/embedding.py, runtime/serve/embed.py, `sparkq embed`): a tiny random Qwen3
checkpoint with Qwen3-Embedding's sentence-transformers files (last-token pooling, Normalize; its tokenizer
appends the EOS token) against sentence-transformers and transformers' own hidden states, the int4 artifact
against the bf16 checkpoint, /v1/embeddings through the `openai` client, /v1/rerank over plain HTTP (the cosine
of an embedding model, the P(yes) judge of a model without pooling files), and bad requests."""
import base64
import contextlib
import importlib
import json
import shutil
import threading
from importlib.util import find_spec

import numpy as np
import pytest

from helpers import byte_tokenizer, make_llama, run_cli
from sparkq.convert.pipeline import Options, convert

TEXTS = ["Instruct: find the capital\nQuery: capital of France", "Paris is the capital of France.",
         "a", "the quick brown fox jumps over the lazy dog " * 3]
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


def _st_files(d, hidden):
    """Qwen3-Embedding's sentence-transformers files (last-token pooling, then Normalize)"""
    (d / "modules.json").write_text(json.dumps(MODULES))
    (d / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{f"pooling_mode_{m}": m == "lasttoken" for m in modes},
         "include_prompt": True}))
    (d / "2_Normalize").mkdir(exist_ok=True)
    (d / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                              "query\nQuery:", "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(bf16 checkpoint, int4 embedding artifact, int4 judge artifact: the same without pooling files)"""
    from tokenizers import Tokenizer, processors

    d = tmp_path_factory.mktemp("embed")
    src = make_llama(d / "src", arch="qwen3", hidden=128, layers=2, seed=11)
    tok = Tokenizer.from_str(byte_tokenizer(320))
    tok.add_tokens(["yes", "no"])  # single tokens, as a Qwen3 vocabulary has them
    eos = tok.token_to_id("<|eos|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|eos|>", special_tokens=[("<|eos|>", eos)])
    (src / "tokenizer.json").write_text(tok.to_str())
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "pad_token": "<|eos|>",
                                                           "padding_side": "left"}))
    _st_files(src, 128)
    art = d / "art"
    convert(str(src), str(art), Options(progress=False, method="minmax"))
    judge = d / "judge"
    shutil.copytree(art, judge)
    for n in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "1_Pooling"):
        (shutil.rmtree if (judge / n).is_dir() else (judge / n).unlink)(judge / n)
    return src, art, judge


def _lite(art, slots=1):
    from sparkq.runtime.lite import load
    return load(str(art), max_model_len=512, kv_budget_mib=8, threads=2, slots=slots)


@pytest.fixture(scope="module")
def bf16_vectors(models):
    from sparkq.runtime.embedding import Embedder
    from sparkq.runtime.torchrt import load
    src = models[0]
    m = load(str(src), max_model_len=256, kv_budget_mib=8, threads=2, kv_dtype="bf16")
    return np.stack(Embedder(m, path=src).embed(TEXTS))


def _cos(a, b):
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_convert_carries_the_pooling_files(models):
    from sparkq.runtime.embedding import read_pooling
    src, art, judge = models
    for n in ("modules.json", "1_Pooling/config.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        assert (art / n).read_bytes() == (src / n).read_bytes()
    p = read_pooling(art)
    assert (p.mode, p.normalize, p.embedding_model) == ("lasttoken", True, True) and "query" in p.prompts
    p = read_pooling(judge)  # no files: the last token, normalized, not an embedding model
    assert (p.mode, p.normalize, p.embedding_model) == ("lasttoken", True, False)


def test_bf16_checkpoint_against_sentence_transformers_and_transformers(models, bf16_vectors):
    """the bf16 checkpoint through the C core (the torch runtime's Session, bf16 KV) against the oracles"""
    import torch
    import transformers
    src = models[0]
    hf = transformers.AutoModel.from_pretrained(str(src), torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    ref = []
    with torch.no_grad():
        for t in TEXTS:  # last-token pooling of the final-normed hidden state, L2-normalized
            ids = tok(t, return_tensors="pt")
            assert ids["input_ids"][0, -1] == tok.convert_tokens_to_ids("<|eos|>")  # the post-processor's EOS
            h = hf(**ids).last_hidden_state[0, -1]
            ref.append((h / h.norm()).numpy())
    cos = _cos(bf16_vectors, np.stack(ref))
    assert cos.min() >= 0.999, cos
    assert np.allclose(np.linalg.norm(bf16_vectors, axis=-1), 1.0, atol=1e-5)
    if find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers is not installed (pip install 'sparkq[test]')")
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(src), device="cpu")
    st_vecs = st.encode(TEXTS, batch_size=1, convert_to_numpy=True)
    cos = _cos(bf16_vectors, st_vecs)
    assert cos.min() >= 0.999, cos


def test_int4_artifact_against_the_bf16_checkpoint(models, bf16_vectors):
    """int4 rows32 weights (minmax) and the int8 KV cache against the bf16 checkpoint: measured cosine
    0.942-0.979 over TEXTS (the same with a bf16 KV cache: the int4 weights' error, which random N(0, 0.08)
    weights with no structure make large; a trained model's is smaller), so >= 0.93; and retrieval holds:
    each int4 vector is nearest its own text's bf16 vector by a wide margin (other texts: cosine <= 0.6).
    The CLI prints the same vectors."""
    from sparkq.runtime.embedding import Embedder
    art = models[1]
    q = np.stack(Embedder(_lite(art)).embed(TEXTS))
    cos = _cos(q, bf16_vectors)
    assert cos.min() >= 0.93, cos
    sim = q @ bf16_vectors.T
    assert (sim.argmax(1) == np.arange(len(TEXTS))).all()
    assert (np.diag(sim) - np.where(np.eye(len(TEXTS), dtype=bool), -1, sim).max(1)).min() > 0.25, sim
    r = run_cli("sparkq", "embed", str(art), *TEXTS[:2], "--json", "--threads", "2", "--max-model-len", "256",
                "--kv-budget-mib", "8")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [o["text"] for o in out] == TEXTS[:2] and np.allclose([o["embedding"] for o in out], q[:2], atol=1e-6)
    r = run_cli("sparkq", "embed", str(art), "hello", "--dimensions", "32", "--threads", "2", "--max-model-len", "256",
                "--kv-budget-mib", "8")
    assert r.returncode == 0 and "lasttoken, normalized" in r.stdout and "   32 " in r.stdout, r.stdout + r.stderr


@contextlib.contextmanager
def _serving(art, slots=2):
    from test_serve import _server
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.serve.server import App

    e = Engine(_lite(art, slots), max_queue=4)
    try:
        with _server(App(e, "tiny")) as url:
            yield url, e
    finally:
        e.close()


def _http():
    return importlib.import_module("httpx" if find_spec("httpx") else "httpx2")  # (openai's own HTTP client)


def test_server_embeddings_openai_client_rerank_and_bad_requests(models):
    from openai import OpenAI

    from sparkq.runtime.embedding import Embedder, cosine, encode
    src, art, judge = models
    direct = Embedder(_lite(art))
    ref = np.stack(direct.embed(TEXTS))
    with _serving(art) as (url, e):
        c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # a chat stream runs beside the embeddings: its tokens are what it gives alone
        alone = e.generate(e.tok.encode("hello there"), 24, ignore_eos=True)
        box = {}
        th = threading.Thread(target=lambda: box.update(e.generate(e.tok.encode("hello there"), 24, ignore_eos=True)))
        th.start()
        r = c.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
        th.join()
        assert box["ids"] == alone["ids"]
        got = np.array([d.embedding for d in r.data], np.float32)
        assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == "tiny"
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(encode(e.tok, t)) for t in TEXTS)
        assert np.array_equal(got, ref)  # the engine's prompt slices are Embedder's: the same bits
        r = c.embeddings.create(model="tiny", input=TEXTS[1], dimensions=16)  # the client asks for base64
        v = np.array(r.data[0].embedding, np.float32)
        assert v.size == 16 and abs(np.linalg.norm(v) - 1) < 1e-5 and _cos(v, ref[1][:16]) > 0.9999
        ids = encode(e.tok, TEXTS[0])  # token ids, and base64 over the wire (little-endian float32)
        raw = _http().post(url + "/v1/embeddings", json={"model": "tiny", "input": [ids],
                                                         "encoding_format": "base64"}, timeout=60).json()
        b = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
        assert b.size == 128 and _cos(b, ref[0]) > 0.9999
        # rerank by cosine (an embedding model)
        docs = TEXTS[1:]
        out = _http().post(url + "/v1/rerank", json={"model": "tiny", "query": TEXTS[0], "documents": docs,
                                                     "top_n": 2}, timeout=60).json()
        want = [cosine(ref[0], d) for d in ref[1:]]  # (the documents' prefixes from the prefix cache)
        assert [x["index"] for x in out["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
        assert np.allclose([x["relevance_score"] for x in out["results"]], sorted(want, reverse=True)[:2], atol=1e-6)
        # bad requests: one-line 400s naming the field
        http = _http()
        for body, field in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"),
                            ({"input": [["a"]]}, "input"), ({"input": "x" * 600}, "input"),
                            ({"input": "a", "dimensions": 0}, "dimensions"),
                            ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                            ({"input": "a", "truncate": True}, "truncate"), ({"input": [[99999]]}, "input")]:
            resp = http.post(url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == field and "\n" not in err["message"], (body, err)
        resp = http.post(url + "/v1/embeddings", json={"model": "tiny", "input": ["a", "x" * 600]}, timeout=60)
        assert resp.status_code == 400 and "input[1] is 601 tokens" in resp.json()["error"]["message"]
        assert "at most 511 tokens" in resp.json()["error"]["message"]
        for body, field in [({"query": "", "documents": ["a"]}, "query"), ({"query": "q", "documents": []}, "documents"),
                            ({"query": "q", "documents": [1]}, "documents"),
                            ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n")]:
            resp = http.post(url + "/v1/rerank", json={"model": "tiny", **body}, timeout=60)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field, body
        assert e.load()["running"] == 0 and len(e.free) == 2  # every embedding request left its slot


def test_rerank_judge_p_yes_ordering_matches_direct_scores(models):
    """a model without pooling files judges: P(yes) of Qwen3-Reranker's prompt, the same scores as
    computed directly, sorted; the shared judging prefix comes from the prefix cache"""
    from sparkq.runtime.embedding import JUDGE_PREFIX, JUDGE_SUFFIX, Embedder
    judge = models[2]
    query = "what is the capital of France?"
    docs = ["Paris is the capital of France.", "bananas are yellow", "no", "yes yes yes", "the capital is Paris"]
    direct = Embedder(_lite(judge))
    assert not direct.pooling.embedding_model
    ids = direct.judge().ids(query, docs[0])
    text = direct.tok.decode(ids)
    assert text.startswith(JUDGE_PREFIX[:40]) and text.endswith(JUDGE_SUFFIX) and "<Document>: Paris" in text
    want = direct.rerank(query, docs)
    assert all(0 < s < 1 for s in want)
    with _serving(judge) as (url, e):
        out = _http().post(url + "/rerank", json={"query": query, "documents": docs, "return_documents": True},
                           timeout=60).json()
    got = {x["index"]: x["relevance_score"] for x in out["results"]}
    assert np.allclose([got[i] for i in range(len(docs))], want, atol=1e-4)
    scores = [x["relevance_score"] for x in out["results"]]
    assert scores == sorted(scores, reverse=True) and [x["document"]["text"] for x in out["results"]][0] == \
        docs[out["results"][0]["index"]]
    assert [x["index"] for x in out["results"]] == sorted(range(len(docs)), key=lambda i: -got[i])
    gaps = np.diff(sorted(want))  # the ordering is the direct scores' where they are apart
    if gaps.min() > 1e-3:
        assert [x["index"] for x in out["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])
    assert out["usage"]["prompt_tokens"] == sum(len(direct.judge().ids(query, d)) for d in docs)


def test_mean_pooling_against_sentence_transformers_and_through_the_server(models, tmp_path):
    """1_Pooling/config.json saying mean_tokens: the mean of every row's state (no prefix reuse on the
    server, so the same text twice gives the same vector), against the oracle on the bf16 checkpoint"""
    from sparkq.runtime.embedding import Embedder
    from sparkq.runtime.torchrt import load
    src, art, _ = models
    for d in (src, art):
        shutil.copytree(d, tmp_path / d.name)
        p = tmp_path / d.name / "1_Pooling" / "config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "pooling_mode_lasttoken": False,
                                 "pooling_mode_mean_tokens": True}))
    src, art = tmp_path / src.name, tmp_path / art.name
    m = load(str(src), max_model_len=256, kv_budget_mib=8, threads=2, kv_dtype="bf16")
    mine = Embedder(m, path=src)
    assert mine.pooling.mode == "mean"
    vecs = np.stack(mine.embed(TEXTS))
    if find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer
        ref = SentenceTransformer(str(src), device="cpu").encode(TEXTS, batch_size=1, convert_to_numpy=True)
        assert _cos(vecs, ref).min() >= 0.999
    direct = np.stack(Embedder(_lite(art)).embed(TEXTS))
    with _serving(art) as (url, e):
        for _ in range(2):  # the second time the slots hold these prompts: still every row prefilled
            out = _http().post(url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
            assert np.array_equal(np.array([d["embedding"] for d in out["data"]], np.float32), direct)
