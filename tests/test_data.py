"""Tests of the data pipeline (trainer/data/tokenizer.py, trainer/data/batches.py) on real local files."""

import os

# Never touch the network: must be set before `datasets` is first imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch

from trainer.data import corpus
from trainer.data.batches import (
    DataConfig,
    DataError,
    TokenBatches,
    build_data,
    make_loader,
)
from trainer.data.corpus import load_tokens
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

WIKI = corpus.SHARED_WIKITEXT2
needs_wiki = pytest.mark.skipif(not (WIKI / "valid.txt").is_file(), reason=f"{WIKI} not present")


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory):
    """A private datasets cache so tests neither read nor litter ~/.cache."""
    return str(tmp_path_factory.mktemp("hf_datasets_cache"))


@pytest.fixture(scope="session")
def wiki(hf_cache):
    """(tokenizer, train, val) on WikiText-2 valid/test: seq_len 64, B 8, M 2."""
    return build_data(DataConfig(cache_dir=hf_cache), seq_len=64, global_batch_size=8, micro_batches=2, seed=1234)


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    text = "Homarus gammarus = European lobster; naïve café — 🦞\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # eos decodes to nothing
    joined = tok.encode_documents(["ab", "", "c"]).tolist()
    assert joined == [97, 98, 256, 256, 99]


def _train_bpe(path, special):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the european lobster is blue", "the lobster turns red on cooking", "lobsters mate in summer"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_json_round_trip(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json", ["<pad>", "<|endoftext|>"])
    tok = build_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 1 and tok.vocab_size >= 258
    text = "the blue lobster turns red, naïve!"
    ids = tok.encode(text)
    assert tok.eos_id not in ids and len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    # documents are joined with eos between them
    a, b = tok.encode("lobster"), tok.encode("summer")
    assert tok.encode_documents(["lobster", "summer"]).tolist() == a + [tok.eos_id] + b
    # a directory holding tokenizer.json works too
    assert build_tokenizer(str(tmp_path)).eos_id == tok.eos_id


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data\.tokenizer.*nope\.json"):
        build_tokenizer(str(tmp_path / "nope.json"))
    path = _train_bpe(tmp_path / "no_eos.json", ["<pad>"])
    with pytest.raises(ValueError, match=r"data\.tokenizer.*no_eos\.json.*end-of-sequence"):
        build_tokenizer(str(path))


# ----------------------------------------------------------------------------- wikitext


@needs_wiki
def test_wikitext_tokens_are_the_file_bytes(wiki):
    tok, train, val = wiki
    raw = (WIKI / "valid.txt").read_bytes()
    toks = load_tokens(DataConfig(), "valid", tok)
    assert toks.dtype == torch.int32 and toks.numel() == train.num_tokens
    eos = toks == tok.eos_id
    assert bytes(toks[~eos].to(torch.uint8).tolist()) == raw  # nothing lost or altered
    assert 50 <= int(eos.sum()) <= 70  # one eos between consecutive articles (60 articles)
    assert train.num_sequences == toks.numel() // 65 and train.batches_per_epoch == train.num_sequences // 8
    assert val.num_sequences == load_tokens(DataConfig(), "test", tok).numel() // 65


@needs_wiki
def test_shapes_and_labels_are_shifted_inputs(wiki):
    tok, train, val = wiki
    for dp_rank, dp_size in [(0, 1), (1, 2), (3, 4)]:
        x, y = train.local_batch(7, dp_rank, dp_size)
        assert x.shape == y.shape == (8 // dp_size, 64)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a contiguous slice of the packed stream
    idx = train.global_indices(7)
    x, y = train.global_batch(7)
    toks = load_tokens(DataConfig(), "valid", tok)
    for r, i in enumerate(idx.tolist()):
        seq = toks[i * 65 : (i + 1) * 65].long()
        assert torch.equal(x[r], seq[:-1]) and torch.equal(y[r], seq[1:])


@needs_wiki
def test_batches_reproducible_across_objects_and_call_order(wiki, hf_cache):
    _, train, _ = wiki
    bpe = train.batches_per_epoch
    steps = [0, 1, 2, bpe - 1, bpe, bpe + 5, 3 * bpe + 2]
    forward = {s: train.local_batch(s, 1, 2) for s in steps}
    corpus._TOKEN_CACHE.clear()  # a fresh load, a fresh object, the reverse order
    _, fresh, _ = build_data(DataConfig(cache_dir=hf_cache), 64, 8, 2, seed=1234)
    assert fresh is not train
    for s in reversed(steps):
        x, y = fresh.local_batch(s, 1, 2)
        assert torch.equal(x, forward[s][0]) and torch.equal(y, forward[s][1])
    # re-reading an old batch after later ones gives the same batch
    assert torch.equal(train.local_batch(0, 1, 2)[0], forward[0][0])


@needs_wiki
def test_steps_epochs_and_seeds_differ(wiki):
    _, train, _ = wiki
    bpe = train.batches_per_epoch
    assert not torch.equal(train.global_batch(0)[0], train.global_batch(1)[0])
    assert not torch.equal(train.global_batch(0)[0], train.global_batch(bpe)[0])  # new epoch, new order
    # within an epoch no sequence repeats
    seen = torch.cat([train.global_indices(s) for s in range(bpe)])
    assert seen.unique().numel() == seen.numel() == bpe * 8
    other = TokenBatches(train.tokens, 64, 8, 2, seed=1235)
    assert not torch.equal(other.global_indices(0), train.global_indices(0))


@needs_wiki
def test_dp_layout_matches_single_process_micro_batches(wiki):
    _, train, _ = wiki
    M, dp = 2, 2
    for step in (0, 3, train.batches_per_epoch + 1):
        single_x, single_y = train.local_batch(step, 0, 1)
        assert torch.equal(single_x, train.global_batch(step)[0])
        single_micro = single_x.chunk(M)
        ranks = [train.local_batch(step, r, dp) for r in range(dp)]
        for m in range(M):
            union = torch.cat([x.chunk(M)[m] for x, _ in ranks])
            assert torch.equal(union, single_micro[m])
            union_y = torch.cat([y.chunk(M)[m] for _, y in ranks])
            assert torch.equal(union_y, single_y.chunk(M)[m])


@needs_wiki
def test_divisibility_errors(wiki):
    _, train, _ = wiki
    with pytest.raises(DataError, match=r"training\.batch_size \(8\).*training\.micro_batches \(3\)"):
        TokenBatches(train.tokens, 64, 8, 3, 0)
    assert train.local_batch(0, 3, 4)[0].shape == (2, 64)  # 8 = 2 micro x 4 ranks x 1
    with pytest.raises(DataError, match=r"training\.batch_size.*training\.micro_batches.*data-parallel size \(3\)"):
        train.local_batch(0, 0, 3)
    with pytest.raises(DataError, match="dp_rank"):
        train.local_batch(0, 2, 2)


@needs_wiki
def test_val_batches_are_fixed_blocks_sharded_like_train(wiki):
    tok, _, val = wiki
    toks = load_tokens(DataConfig(), "test", tok)
    assert val.num_batches == (toks.numel() // 65) // 8
    for i in (0, 1, val.num_batches - 1):
        x, y = val.global_batch(i)
        block = toks[i * 8 * 65 : (i + 1) * 8 * 65].long().view(8, 65)
        assert torch.equal(x, block[:, :-1]) and torch.equal(y, block[:, 1:])
        assert torch.equal(val.val_batch(i)[0], x)
        ranks = [val.val_batch(i, r, 2)[0] for r in range(2)]
        for m in range(2):
            assert torch.equal(torch.cat([r.chunk(2)[m] for r in ranks]), x.chunk(2)[m])
    with pytest.raises(IndexError):
        val.val_batch(val.num_batches)


# ----------------------------------------------------------------------------- errors


@needs_wiki
def test_missing_path_split_and_too_small(tmp_path, hf_cache):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(DataError, match=r"^data\.dataset: path .*no_such_dir.* does not exist"):
        build_data(DataConfig(dataset=str(missing), cache_dir=hf_cache), 64, 8, 1, 0)
    with pytest.raises(DataError, match=r"^data\.train_split: no file for split 'train' .*wikitext-2"):
        build_data(DataConfig(train_split="train", cache_dir=hf_cache), 64, 8, 1, 0)
    with pytest.raises(DataError, match=r"^data\.val_split: no file for split 'validation'"):
        build_data(DataConfig(val_split="validation", cache_dir=hf_cache), 64, 8, 1, 0)
    # 1.1 MB of bytes is 1064 sequences of 1025 tokens; a 2048-sequence batch does not fit
    with pytest.raises(
        DataError, match=r"^data\.dataset: .*valid\.txt.*fewer than one global batch.*training\.batch_size=2048"
    ):
        build_data(DataConfig(cache_dir=hf_cache), 1024, 2048, 1, 0)


def test_source_resolution_without_network(tmp_path, monkeypatch):
    # wikitext-2 without ../shared/data falls back to the hub, with hub split names
    monkeypatch.setattr(corpus, "SHARED_WIKITEXT2", tmp_path / "absent")
    src = corpus.resolve_source(DataConfig(), "valid", "data.train_split")
    assert (src.kind, src.hub_id, src.hub_config, src.hub_split) == (
        "hub",
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
        "validation",
    )
    assert corpus.resolve_source(DataConfig(), "test", "data.val_split").hub_split == "test"
    # other names: owner/name is a hub id, path-like strings are missing local paths
    src = corpus.resolve_source(DataConfig(dataset="owner/corpus", hub_config="en"), "train", "data.train_split")
    assert (src.kind, src.hub_id, src.hub_config, src.hub_split) == ("hub", "owner/corpus", "en", "train")
    for bad in ("./nope", "a/b/c", "nope.jsonl", str(tmp_path / "x")):
        with pytest.raises(DataError, match=r"^data\.dataset: path .* does not exist"):
            corpus.resolve_source(DataConfig(dataset=bad), "train", "data.train_split")


def test_single_file_and_text_grouping(tmp_path, hf_cache):
    f = tmp_path / "corpus.txt"
    f.write_text(" = First = \n \n alpha beta \n = = Sub = = \n gamma \n = Second = \n delta \n")
    cfg = DataConfig(dataset=str(f), val_split="", cache_dir=hf_cache)
    tok, train, val = build_data(cfg, seq_len=3, global_batch_size=2, micro_batches=1, seed=0)
    assert val is None
    toks = load_tokens(cfg, "anything", tok).tolist()
    first = " = First = \n \n alpha beta \n = = Sub = = \n gamma \n"
    second = " = Second = \n delta \n"
    assert toks == tok.encode(first) + [tok.eos_id] + tok.encode(second)
    with pytest.raises(DataError, match=r"^data\.dataset: .*corpus\.txt.*fewer than one global batch"):
        build_data(cfg, seq_len=64, global_batch_size=8, micro_batches=1, seed=0)


def test_text_files_are_read_as_the_datasets_text_builder_reads_them(tmp_path, hf_cache):
    """Plain text is read without `datasets` (a restart's start-up cost); the lines are the ones its
    `text` builder yields: CRLF, a form feed, Unicode line separators, no final newline, several files."""
    import datasets

    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_bytes(" = A = \r\n x\x0cy \u2028z\n\n tail\u0085".encode())
    files[1].write_bytes(b"first\rsecond\r\n = B = \n last without newline")
    paths = [str(f) for f in files]
    ds = datasets.load_dataset(
        "text", data_files={"split": paths}, split="split", keep_linebreaks=True, cache_dir=hf_cache
    )
    assert list(corpus.read_text_lines(paths)) == ds.data.column("text").to_pylist()


def test_local_directory_of_json_jsonl_parquet(tmp_path, hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "corpus"
    d.mkdir()
    train_docs = [f"train document {i} about lobsters" for i in range(40)]
    val_docs = [f"validation document {i}" for i in range(30)]
    test_docs = [f"test document {i} in parquet" for i in range(30)]
    with open(d / "train.jsonl", "w") as fh:
        for i, t in enumerate(train_docs):
            fh.write(json.dumps({"id": i, "content": t}) + "\n")
    (d / "valid.json").write_text(json.dumps([{"id": i, "content": t} for i, t in enumerate(val_docs)]))
    pq.write_table(pa.table({"id": list(range(30)), "content": test_docs}), d / "test.parquet")
    (d / "README.md").write_text("not data")

    tok = ByteTokenizer()
    cfg = DataConfig(dataset=str(d), text_field="content", train_split="train", val_split="valid", cache_dir=hf_cache)
    for split, docs in [("train", train_docs), ("valid", val_docs), ("test", test_docs)]:
        want = []
        for i, t in enumerate(docs):
            want += ([tok.eos_id] if i else []) + tok.encode(t)
        assert load_tokens(cfg, split, tok).tolist() == want, split
    _, train, val = build_data(cfg, seq_len=15, global_batch_size=4, micro_batches=2, seed=0)
    assert train.local_batch(0, 1, 2)[0].shape == (2, 15) and val.num_batches >= 1

    # shards of one split are read in name order; other stems are not picked up
    s = tmp_path / "sharded"
    s.mkdir()
    for k, docs in enumerate([train_docs[:20], train_docs[20:]]):
        (s / f"train-{k:05d}-of-00002.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in docs))
    (s / "train_small.jsonl").write_text(json.dumps({"content": "decoy"}) + "\n")
    scfg = DataConfig(dataset=str(s), text_field="content", cache_dir=hf_cache)
    assert load_tokens(scfg, "train", tok).tolist() == load_tokens(cfg, "train", tok).tolist()

    with pytest.raises(DataError, match=r"^data\.text_field: column 'text' not found.*columns: \['id', 'content'\]"):
        load_tokens(DataConfig(dataset=str(d), cache_dir=hf_cache), "train", tok)
    with pytest.raises(
        DataError,
        match=r"^data\.val_split: no file for split 'dev'.*found: \['test\.parquet', 'train\.jsonl', 'valid\.json'\]",
    ):
        build_data(
            DataConfig(dataset=str(d), text_field="content", train_split="train", val_split="dev", cache_dir=hf_cache),
            15,
            4,
            2,
            0,
        )


# ----------------------------------------------------------------------------- datasets saved with save_to_disk


def _saved_corpus(root):
    """The same two splits as a jsonl directory, a saved DatasetDict and (train alone) a saved Dataset."""
    import datasets

    docs = {
        "train": [f"train document {i}: {'lobster ' * (i % 5)}" for i in range(60)],
        "validation": [f"validation document {i}" for i in range(30)],
    }
    jsonl = root / "jsonl"
    jsonl.mkdir()
    for split, texts in docs.items():
        (jsonl / f"{split}.jsonl").write_text(
            "".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts))
        )
    saved = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"id": list(range(len(t))), "body": t}) for split, t in docs.items()}
    )
    saved.save_to_disk(str(root / "dict"))
    saved["train"].save_to_disk(str(root / "single"))
    return jsonl, root / "dict", root / "single"


def _batches(batches: TokenBatches, steps: int = 6) -> list[list[list[int]]]:
    return [t.tolist() for step in range(steps) for t in batches.local_batch(step, 1, 2)]


def test_save_to_disk_dataset_dict_and_dataset_give_the_jsonl_batches(tmp_path, hf_cache):
    """data.dataset naming a save_to_disk directory is read with load_from_disk: a DatasetDict's split is the one
    the split key names, a Dataset is every split; batches (in memory and prepared) are the jsonl's."""
    from trainer.data import prepare

    jsonl, saved_dict, saved_one = _saved_corpus(tmp_path)
    common = dict(text_field="body", train_split="train", cache_dir=hf_cache)
    _, want_train, want_val = build_data(DataConfig(dataset=str(jsonl), val_split="validation", **common), 15, 4, 2, 0)
    _, train, val = build_data(DataConfig(dataset=str(saved_dict), val_split="validation", **common), 15, 4, 2, 0)
    assert _batches(train) == _batches(want_train)
    assert val.num_batches == want_val.num_batches >= 1
    assert val.val_batch(0, 0, 2)[0].tolist() == want_val.val_batch(0, 0, 2)[0].tolist()
    assert train.name.startswith(repr(str(saved_dict / "train")))
    _, single, _ = build_data(DataConfig(dataset=str(saved_one), val_split="", **common), 15, 4, 2, 0)
    assert _batches(single) == _batches(want_train)

    out = tmp_path / "prepared"
    overrides = ["--data.text_field", "body", "--data.train_split", "train", "--data.val_split", "validation"]
    assert prepare.main(["--out", str(out), "--data.dataset", str(saved_dict), *overrides]) == 0
    _, prepared, _ = build_data(DataConfig(dataset=str(out), val_split="validation", **common), 15, 4, 2, 0)
    assert _batches(prepared) == _batches(want_train)


def test_saved_dataset_and_unreadable_directory_errors_are_one_line(tmp_path, hf_cache, capsys):
    from trainer.data import prepare

    _, saved_dict, saved_one = _saved_corpus(tmp_path)
    with pytest.raises(
        DataError,
        match=r"^data\.train_split: no split 'valid' in the DatasetDict saved at .*dict' \(splits: \['train', 'valid",
    ):
        build_data(DataConfig(dataset=str(saved_dict), text_field="body", cache_dir=hf_cache), 15, 4, 2, 0)
    for arrow in saved_one.glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(DataError, match=r"^data\.dataset: could not read the dataset saved at .*single' with datasets"):
        build_data(DataConfig(dataset=str(saved_one), val_split="", cache_dir=hf_cache), 15, 4, 2, 0)

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "weights.bin").write_bytes(b"\0")
    (junk / "notes").mkdir()
    (junk / "notes" / "train.jsonl").write_text("{}\n")  # not the split's sub-directory: not data
    capsys.readouterr()  # save_to_disk's progress bars
    assert prepare.main(["--out", str(tmp_path / "out"), "--data.dataset", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data.dataset: directory "), err
    assert "holds no data for data.train_split='valid'" in err and "found: ['notes/', 'weights.bin']" in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- StatefulDataLoader


@needs_wiki
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_resumes_at_next_step(wiki, num_workers):
    _, train, _ = wiki
    loader = make_loader(train, start_step=10, dp_rank=1, dp_size=2, num_workers=num_workers)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    assert [s for s, _, _ in got] == [10, 11, 12]
    for step, x, y in got:
        ex, ey = train.local_batch(step, 1, 2)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    state = loader.state_dict()
    del it

    resumed = make_loader(train, start_step=0, dp_rank=1, dp_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    step, x, y = next(it2)
    assert step == 13
    assert torch.equal(x, train.local_batch(13, 1, 2)[0]) and torch.equal(y, train.local_batch(13, 1, 2)[1])
    assert next(it2)[0] == 14


def test_loader_end_step(hf_cache):
    tokens = torch.arange(100, dtype=torch.int32)
    batches = TokenBatches(tokens, seq_len=4, global_batch_size=4, micro_batches=1, seed=0)
    assert [s for s, _, _ in make_loader(batches, start_step=3, end_step=7)] == [3, 4, 5, 6]
